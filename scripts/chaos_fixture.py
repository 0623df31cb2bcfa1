#!/usr/bin/env python3
"""Fixture for stoke's chaos and partition tests.

Usage: chaos_fixture.py OUT_DIR

Writes into OUT_DIR (idempotently: a marker file records a complete build):
  parquet/part-N.parquet  30,000 records in 6 files, row groups of 250 rows:
                          id (string "c-00000"), features (fixed_size_list<float32, 64>)
  model.pt                a seeded TorchScript MLP 64 -> 256 -> 256 -> 10

Sizes are chosen so that a job over it takes tens of seconds on a small
machine with a few 1-thread workers and small batches (25 records, see
tests/src/chaos.rs): long enough for a chaos schedule to land mid-shard.
The tests compare the distributed run against an embedded run of the same
spec, so no reference outputs are written here.
"""

import os
import sys
from pathlib import Path

VERSION = "1"
RECORDS = 30_000
FILES = 6
WIDTH = 64
HIDDEN = 256
CLASSES = 10
ROW_GROUP = 250


def main() -> None:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1]).resolve()
    marker = out / ".stoke-chaos-fixture"
    stamp = f"{VERSION} {RECORDS} {out}"
    if marker.exists() and marker.read_text() == stamp:
        return
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    (out / "parquet").mkdir(parents=True, exist_ok=True)
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
        tmp = out / "parquet" / f".part-{f}.parquet.tmp"
        pq.write_table(table, tmp, row_group_size=ROW_GROUP)
        os.replace(tmp, out / "parquet" / f"part-{f}.parquet")

    torch.manual_seed(29)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    ).eval()
    scripted = torch.jit.script(model)
    tmp = out / ".model.pt.tmp"
    scripted.save(str(tmp))
    os.replace(tmp, out / "model.pt")
    marker.write_text(stamp)


if __name__ == "__main__":
    main()
