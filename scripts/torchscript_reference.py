#!/usr/bin/env python3
"""Run a TorchScript model directly over Parquet records: the reference for stoke's tests.

Usage: torchscript_reference.py MODEL_PT PARQUET_DIR_OR_FILE INPUT_COLUMN OUT_JSON [--id-column ID]

Reads the Parquet file, or every *.parquet file directly in the folder (sorted by file
name), and runs the model on each file's rows as one float32 batch [rows, features] on
the CPU under torch.no_grad(). Writes OUT_JSON, an object mapping each record's id
(the id column's value as a string, "id" unless --id-column says otherwise) to
  {"argmax": <index of the largest output>, "scores": [<the model's raw outputs>, ...]}
Scores are float32 values written as JSON numbers that read back to the same float32.

Note: results computed with a different batch size (stoke batches by the job's
batch_size) can differ in the last bits on some CPU kernels, so compare scores with a
small tolerance; argmax should agree except on near-ties.
"""

import argparse
import json
import os
import sys
from pathlib import Path


def fail(msg: str) -> None:
    print(f"torchscript_reference: {msg}", file=sys.stderr)
    sys.exit(1)


def parquet_files(path: Path) -> list:
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.is_file() and p.suffix == ".parquet"),
                       key=lambda p: p.name)
        if not files:
            fail(f"no .parquet files in {path}")
        return files
    if path.is_file():
        return [path]
    fail(f"no such file or folder: {path}")


def column_matrix(column, name: str, path: Path):
    """An Arrow column of lists (fixed or variable size) of numbers -> float32 [rows, width]."""
    import numpy as np
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count:
        fail(f"{path}: column {name!r} has {arr.null_count} null values")
    if pa.types.is_fixed_size_list(arr.type):
        width = arr.type.list_size
        values = arr.flatten()  # honours the array's offset
        if values.null_count:
            fail(f"{path}: column {name!r} has null list elements")
        return values.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(arr), width)
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        rows = arr.to_pylist()
        widths = {len(r) for r in rows}
        if len(widths) > 1:
            fail(f"{path}: column {name!r} has lists of different lengths {sorted(widths)[:5]}")
        try:
            return np.asarray(rows, dtype=np.float32).reshape(len(rows), -1)
        except (TypeError, ValueError) as e:
            fail(f"{path}: column {name!r}: {e}")
    if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type):
        return arr.to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(arr), 1)
    fail(f"{path}: column {name!r} has type {arr.type}, expected a list of numbers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("parquet")
    ap.add_argument("input_column")
    ap.add_argument("out_json")
    ap.add_argument("--id-column", default="id")
    args = ap.parse_args()

    import pyarrow.parquet as pq
    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model = torch.jit.load(args.model, map_location="cpu")
    model.eval()

    result = {}
    for path in parquet_files(Path(args.parquet)):
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        for col in (args.id_column, args.input_column):
            if col not in names:
                fail(f"{path}: no column {col!r} (columns: {', '.join(names)})")
        table = pf.read(columns=[args.id_column, args.input_column])
        ids = [None if v is None else str(v) for v in table.column(args.id_column).to_pylist()]
        if any(v is None for v in ids):
            fail(f"{path}: column {args.id_column!r} has null ids")
        if not ids:
            continue
        x = torch.from_numpy(column_matrix(table.column(args.input_column), args.input_column, path))
        with torch.no_grad():
            out = model(x)
        if not isinstance(out, torch.Tensor):
            fail(f"model returned {type(out).__name__}, expected a tensor")
        out = out.detach().to(torch.float32).reshape(len(ids), -1)
        argmax = out.argmax(dim=1).tolist()
        scores = out.tolist()
        for i, rid in enumerate(ids):
            if rid in result:
                fail(f"{path}: id {rid!r} appears more than once")
            result[rid] = {"argmax": int(argmax[i]), "scores": scores[i]}

    out_path = Path(args.out_json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(result, f, separators=(",", ":"))
    os.replace(tmp, out_path)
    print(f"torchscript_reference: {len(result)} records -> {out_path}")


if __name__ == "__main__":
    main()
