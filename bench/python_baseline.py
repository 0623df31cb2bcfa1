"""Contender (b): what a user would write by hand in one Python process.
pyarrow reads each Parquet file, numpy -> torch, the TorchScript model runs
per batch of 1024, argmax, and one Parquet file per input file is written
with `id` and `prediction`.

    python bench/python_baseline.py DATA_DIR MODEL OUT_DIR [--threads 2]

Prints `result records=N seconds=S` (S: after imports, for reference; the
benchmark times the whole command).
"""

import argparse
import glob
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

BATCH = 1024


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("model")
    parser.add_argument("out_dir")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    model = torch.jit.load(args.model)
    model.eval()
    os.makedirs(args.out_dir, exist_ok=True)
    total = 0
    for path in sorted(glob.glob(os.path.join(args.data_dir, "*.parquet"))):
        table = pq.read_table(path, columns=["id", "features"])
        features = table.column("features").combine_chunks()
        dim = features.type.list_size
        x = torch.from_numpy(features.flatten().to_numpy().reshape(-1, dim))
        preds = []
        with torch.no_grad():
            for i in range(0, x.shape[0], BATCH):
                preds.append(model(x[i : i + BATCH]).argmax(dim=1))
        prediction = torch.cat(preds).numpy().astype(np.int64)
        out = pa.table({"id": table.column("id"), "prediction": prediction})
        name = os.path.basename(path)
        pq.write_table(out, os.path.join(args.out_dir, name))
        total += out.num_rows
    print(f"result records={total} seconds={time.perf_counter() - started:.4f}")


if __name__ == "__main__":
    main()
