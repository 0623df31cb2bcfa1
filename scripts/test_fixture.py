#!/usr/bin/env python3
"""Test fixture for stoke's integration tests.

Usage: test_fixture.py OUT_DIR

Writes into OUT_DIR (idempotently: a marker file records a complete build):
  parquet/part-N.parquet  3,000 records in 5 files with uneven row groups:
                          id (string "r-00000"), features (fixed_size_list<float32, 16>), group (int64)
  jsonl/part-N.jsonl      the same records as JSON Lines, in 2 files
  long/all.parquet        the same records in one file (row groups of 500), for one long shard
  model.pt                a seeded TorchScript MLP 16 -> 32 -> 5
  reference.json          {id: {"argmax": int, "scores": [5 floats]}}: the model run directly
"""

import json
import os
import sys
from pathlib import Path

VERSION = "2"
RECORDS = 3000
FILES = 5
WIDTH = 16
CLASSES = 5


def main() -> None:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1]).resolve()
    marker = out / ".stoke-test-fixture"
    if marker.exists() and marker.read_text() == f"{VERSION} {out}":
        return
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    (out / "parquet").mkdir(parents=True, exist_ok=True)
    (out / "jsonl").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    features = rng.normal(size=(RECORDS, WIDTH)).astype(np.float32)
    ids = [f"r-{i:05d}" for i in range(RECORDS)]
    groups = (np.arange(RECORDS) % 7).astype(np.int64)

    per_file = RECORDS // FILES
    row_groups = [97, 150, 211, 64, 300]
    for f in range(FILES):
        lo, hi = f * per_file, (f + 1) * per_file
        table = pa.table({
            "id": pa.array(ids[lo:hi], pa.string()),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(features[lo:hi].reshape(-1)), WIDTH),
            "group": pa.array(groups[lo:hi]),
        })
        tmp = out / "parquet" / f".part-{f}.parquet.tmp"
        pq.write_table(table, tmp, row_group_size=row_groups[f])
        os.replace(tmp, out / "parquet" / f"part-{f}.parquet")

    (out / "long").mkdir(parents=True, exist_ok=True)
    table = pa.table({
        "id": pa.array(ids, pa.string()),
        "features": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), WIDTH),
        "group": pa.array(groups),
    })
    tmp = out / "long" / ".all.parquet.tmp"
    pq.write_table(table, tmp, row_group_size=500)
    os.replace(tmp, out / "long" / "all.parquet")

    half = RECORDS // 2
    for f, (lo, hi) in enumerate([(0, half), (half, RECORDS)]):
        tmp = out / "jsonl" / f".part-{f}.jsonl.tmp"
        with open(tmp, "w") as fh:
            for i in range(lo, hi):
                fh.write(json.dumps({"id": ids[i], "features": [float(x) for x in features[i]], "group": int(groups[i])}) + "\n")
        os.replace(tmp, out / "jsonl" / f"part-{f}.jsonl")

    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)).eval()
    scripted = torch.jit.script(model)
    scripted.save(str(out / "model.pt"))
    with torch.no_grad():
        scores = scripted(torch.from_numpy(features)).numpy()
    reference = {
        ids[i]: {"argmax": int(scores[i].argmax()), "scores": [float(x) for x in scores[i]]}
        for i in range(RECORDS)
    }
    (out / "reference.json").write_text(json.dumps(reference))
    marker.write_text(f"{VERSION} {out}")


if __name__ == "__main__":
    main()
