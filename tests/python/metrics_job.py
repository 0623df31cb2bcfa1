"""A torch Dataset job with metric reducers, for the tests: ``python
metrics_job.py ROOT [options as JSON]`` prints the report of
``torch_batch_process(Metered, Numbers(n), ...)``.

``Metered`` wraps a ``MetricReducer`` that returns a dict (``records``,
``mean_prediction``) and two functions (``label_sum``: the sum of the
labels; ``ids``: how many ids were counted and how many distinct ones),
so a test can tell a batch counted twice or lost. At batch
``$STOKE_TEST_HOLD_AT`` it creates ``$STOKE_TEST_HOLD_FILE`` (its process
id) and waits for ``$STOKE_TEST_GO_FILE``; with
``$STOKE_TEST_HOLD_REDUCE`` set, the reduce does the same with
``$STOKE_TEST_HOLD_REDUCE`` as its hold file and that name plus ``.go``
as its go file, once (a second reduce goes on), so a test can kill a
worker mid-job or mid-reduce."""

import json
import os
import pathlib
import sys
import time

import torch
from torch.utils.data import Dataset

from stoke import BadRecord, MetricReducer, TorchBatchProcessor, torch_batch_process


class Numbers(Dataset):
    """Record i: feature i (float) and label i * i."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor(float(i)), i * i


def hold(hold_file, go_file):
    pathlib.Path(hold_file).write_text(str(os.getpid()))
    go = pathlib.Path(go_file)
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


class MeanPrediction(MetricReducer):
    """Records and the mean prediction, as a dict of two metrics."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.total = 0.0
        self.count = 0

    def update(self, predictions):
        self.total += float(predictions.sum())
        self.count += int(predictions.numel())

    def per_slot_reduce(self):
        return self.total, self.count

    def cross_slot_reduce(self, per_slot_metrics):
        hold_file = os.environ.get("STOKE_TEST_HOLD_REDUCE")
        if hold_file and not pathlib.Path(hold_file).exists():
            hold(hold_file, hold_file + ".go")
        total = sum(t for t, _ in per_slot_metrics)
        count = sum(c for _, c in per_slot_metrics)
        return {"records": count, "mean_prediction": total / count if count else None}


def ids_counted(values):
    """[ids counted, distinct ids]: equal and the dataset's length when
    every record counted exactly once."""
    flat = [i for batch in values for i in batch]
    return [len(flat), len(set(flat))]


class Metered(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.mean = context.wrap_reducer(MeanPrediction())
        self.label_sum = context.wrap_reducer(sum, name="label_sum")
        self.ids = context.wrap_reducer(ids_counted, name="ids")
        self.hold_at = int(os.environ.get("STOKE_TEST_HOLD_AT", "-1"))
        # Raise BadRecord for these ids (after updating the reducers).
        self.bad = {int(i) for i in context.params.get("bad", [])}

    def process_batch(self, batch, batch_idx):
        features, labels = batch[0], batch[1]
        predictions = features * 2
        self.mean.update(predictions)
        self.label_sum.update(int(labels.sum()))
        self.ids.update([int(i) for i in batch.ids])
        for i in batch.ids:
            if int(i) in self.bad:
                raise BadRecord(i, "bad on purpose")
        self.context.write_rows({"id": batch.ids, "prediction": predictions})
        if batch_idx == self.hold_at:
            hold(os.environ["STOKE_TEST_HOLD_FILE"], os.environ["STOKE_TEST_GO_FILE"])


def expected(n, left_out=()):
    """The metrics one pass over records 0..n (without ``left_out``) gives."""
    kept = [i for i in range(n) if i not in set(left_out)]
    return {
        "records": len(kept),
        "mean_prediction": sum(2.0 * i for i in kept) / len(kept),
        "label_sum": sum(i * i for i in kept),
        "ids": [len(kept), len(kept)],
    }


def make_dataset():
    """The factory a job spec names: ``[dataset] factory =
    "metrics_job:make_dataset"``."""
    return Numbers(int(os.environ.get("STOKE_TEST_RECORDS", "300")))


def main():
    root = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    n = options.pop("records", 300)
    report = torch_batch_process(Metered, Numbers(n), root=root, **options)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
