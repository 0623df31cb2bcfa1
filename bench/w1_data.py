"""Generates benchmark workload W1, seeded and idempotent.

W1: 200,000 records x 256 float32 in 8 Parquet files (columns `id` string and
`features` fixed_size_list<float32, 256>, one row group per file), and a
TorchScript MLP 256 -> 512 -> 512 -> 10 saved with torch.jit.script.

    python bench/w1_data.py OUT_DIR

writes OUT_DIR/data/part-0.parquet .. part-7.parquet and OUT_DIR/model.pt,
and OUT_DIR/w1.json describing them. Runs again only when w1.json is missing
or describes other parameters.
"""

import argparse
import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

RECORDS = 200_000
DIM = 256
FILES = 8
HIDDEN = 512
CLASSES = 10
SEED = 20240611


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(DIM, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def describe():
    return {
        "records": RECORDS,
        "dim": DIM,
        "files": FILES,
        "hidden": HIDDEN,
        "classes": CLASSES,
        "seed": SEED,
        "format": 1,
    }


def write_data(data_dir):
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(SEED)
    per_file = RECORDS // FILES
    assert per_file * FILES == RECORDS
    for f in range(FILES):
        start = f * per_file
        x = rng.standard_normal((per_file, DIM), dtype=np.float32)
        ids = pa.array([f"r{i:07d}" for i in range(start, start + per_file)], pa.string())
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), pa.float32()), DIM)
        table = pa.table({"id": ids, "features": features})
        tmp = os.path.join(data_dir, f".part-{f}.parquet.tmp")
        # One row group per file: stoke cuts Parquet by row groups, so with
        # sharding.records = 25000 every file is one shard.
        pq.write_table(table, tmp, row_group_size=per_file)
        os.replace(tmp, os.path.join(data_dir, f"part-{f}.parquet"))


def write_model(path):
    torch.manual_seed(SEED)
    model = MLP().eval()
    scripted = torch.jit.script(model)
    tmp = path + ".tmp"
    scripted.save(tmp)
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    args = parser.parse_args()
    out = os.path.abspath(args.out_dir)
    marker = os.path.join(out, "w1.json")
    want = describe()
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == want:
                print(f"w1: already generated in {out}", file=sys.stderr)
                return
    os.makedirs(out, exist_ok=True)
    write_data(os.path.join(out, "data"))
    write_model(os.path.join(out, "model.pt"))
    with open(marker + ".tmp", "w") as f:
        json.dump(want, f, indent=1)
    os.replace(marker + ".tmp", marker)
    print(f"w1: wrote {RECORDS} records in {FILES} files and model.pt to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
