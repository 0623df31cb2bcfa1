"""A torch Dataset job for the tests: ``python dataset_job.py ROOT [options
as JSON]``. The processor writes each record's id, the label the dataset
gave, and batch_idx; it logs every batch it processes (to
``$STOKE_TEST_BATCH_LOG``), and at batch ``$STOKE_TEST_HOLD_AT`` it creates
``$STOKE_TEST_HOLD_FILE`` (holding its process id) and waits until ``$STOKE_TEST_GO_FILE`` exists
(or is killed), so a test can signal or kill it mid-job."""

import json
import os
import pathlib
import sys
import time

import torch
from torch.utils.data import Dataset

from stoke import TorchBatchProcessor, torch_batch_process


class Squares(Dataset):
    """Record i: features [i, i/2] and label i*i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([float(i), i / 2.0]), i * i


class Recorder(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.log = os.environ.get("STOKE_TEST_BATCH_LOG")
        self.hold_at = int(os.environ.get("STOKE_TEST_HOLD_AT", "-1"))

    def process_batch(self, batch, batch_idx):
        features, labels = batch[0], batch[1]
        assert features.shape == (len(batch.ids), 2), features.shape
        assert [int(i) for i in batch.ids] == [int(f) for f in features[:, 0].tolist()]
        n = len(batch.ids)
        distributed = self.context.distributed
        self.context.write_rows({"id": batch.ids, "label": labels, "batch_idx": [batch_idx] * n,
                                 "rank": [distributed.get_rank()] * n, "size": [distributed.get_size()] * n})
        with open(self.context.get_tensorboard_path() / "events.txt", "a") as f:
            f.write(f"{batch_idx}\n")
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{batch_idx}\n")
        if batch_idx == self.hold_at:
            pathlib.Path(os.environ["STOKE_TEST_HOLD_FILE"]).write_text(str(os.getpid()))
            go = pathlib.Path(os.environ["STOKE_TEST_GO_FILE"])
            deadline = time.monotonic() + 120
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.02)


def make_dataset():
    """The factory a job spec names: ``[dataset] factory =
    "dataset_job:make_dataset"``."""
    return Squares(int(os.environ.get("STOKE_TEST_RECORDS", "300")))


def main():
    root = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    n = options.pop("records", 300)
    report = torch_batch_process(Recorder, Squares(n), root=root, **options)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
