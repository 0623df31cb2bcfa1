#!/usr/bin/env python3
"""Fixture for stoke's chaos and partition tests.

Usage: chaos_fixture.py OUT_DIR

Writes into OUT_DIR (idempotently: a marker file records a complete build):
  parquet/part-N.parquet  30,000 records in 6 files, row groups of 250 rows:
                          id (string "c-00000"), features (fixed_size_list<float32, 64>)
  model.pt                a seeded TorchScript MLP 64 -> 512 -> 512 -> 10 whose hidden
                          layer is applied ROUNDS times (h = tanh(W h + U x), W a
                          contraction, so outputs depend on the input and are stable)

Sizes are chosen so that a job over it takes tens of seconds on a small
machine (2 cores, 3 workers at 1 libtorch thread, batches of 25 records,
shards of 750; see tests/src/chaos.rs): about 25 s undisturbed, long enough
for a chaos schedule to land mid-shard. Repeating one layer gives the
compute of a deep network while the model file stays small (about 1 MB).
  reference/part-N.json   each record's outputs as torch computes them here, in
                          Python ({id: {"argmax": int, "scores": [10 floats]}}):
                          what the tests check the distributed runs against,
                          independently of stoke's own code paths

Safe to run concurrently on the same OUT_DIR (temporary names are per
process, outside the folders jobs read; each file appears atomically; the
marker is written last).
"""

import os
import sys
from pathlib import Path

VERSION = "3"
RECORDS = 30_000
FILES = 6
WIDTH = 64
HIDDEN = 512
ROUNDS = 192
CLASSES = 10
ROW_GROUP = 250


def model_class():
    import torch

    class ChaosNet(torch.nn.Module):
        rounds: int

        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(WIDTH, HIDDEN)
            self.hidden = torch.nn.Linear(HIDDEN, HIDDEN)
            self.out = torch.nn.Linear(HIDDEN, CLASSES)
            # A contraction (tanh' <= 1): each round shrinks differences, so
            # the result is a stable function of the input.
            torch.nn.init.orthogonal_(self.hidden.weight, gain=0.8)
            self.rounds = ROUNDS

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            u = self.inp(x)
            h = torch.tanh(u)
            for _ in range(self.rounds):
                h = torch.tanh(self.hidden(h) + u)
            return self.out(h)

    return ChaosNet


def main() -> None:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1]).resolve()
    marker = out / ".stoke-chaos-fixture"
    stamp = f"{VERSION} {RECORDS} {HIDDEN} {ROUNDS} {out}"
    if marker.exists() and marker.read_text() == stamp:
        return
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    (out / "parquet").mkdir(parents=True, exist_ok=True)
    # Files are written outside parquet/ and moved in whole, so a job that
    # lists parquet/ while another process builds the fixture sees no
    # partial files.
    staging = out / f".staging-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20240611)
    features = rng.normal(size=(RECORDS, WIDTH)).astype(np.float32)
    ids = [f"c-{i:05d}" for i in range(RECORDS)]

    per_file = RECORDS // FILES
    for f in range(FILES):
        lo, hi = f * per_file, (f + 1) * per_file
        table = pa.table({
            "id": pa.array(ids[lo:hi], pa.string()),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(features[lo:hi].reshape(-1)), WIDTH),
        })
        tmp = staging / f"part-{f}.parquet"
        pq.write_table(table, tmp, row_group_size=ROW_GROUP)
        os.replace(tmp, out / "parquet" / f"part-{f}.parquet")

    ChaosNet = model_class()
    torch.manual_seed(29)
    scripted = torch.jit.script(ChaosNet().eval())
    tmp = staging / "model.pt"
    scripted.save(str(tmp))
    os.replace(tmp, out / "model.pt")

    # The reference, by torch in this process: the saved model, loaded
    # back, on each file's records (1 thread, batches of 250).
    import json

    torch.set_num_threads(1)
    model = torch.jit.load(str(out / "model.pt"))
    (out / "reference").mkdir(exist_ok=True)
    with torch.inference_mode():
        for f in range(FILES):
            lo, hi = f * per_file, (f + 1) * per_file
            x = torch.from_numpy(features[lo:hi])
            scores = torch.cat([model(c) for c in torch.split(x, 250)]).numpy()
            ref = {
                ids[lo + i]: {"argmax": int(scores[i].argmax()), "scores": [float(v) for v in scores[i]]}
                for i in range(hi - lo)
            }
            tmp = staging / f"part-{f}.json"
            tmp.write_text(json.dumps(ref))
            os.replace(tmp, out / "reference" / f"part-{f}.json")
    staging.rmdir()
    marker.write_text(stamp)


if __name__ == "__main__":
    main()
