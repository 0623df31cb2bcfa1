"""Reads a job's output folder the way users do: as a Parquet dataset.

Usage: read_outputs.py FOLDER

Prints one JSON object: for each reader that is installed, the rows it read
as [id, prediction] pairs (every row, duplicates included). The tests
compare them with the manifest, so an object in the folder that no commit
counts shows up as an extra row.

- pyarrow: `pyarrow.dataset.dataset(FOLDER)`, which skips files and folders
  whose names start with `_` or `.` (as Spark and Hadoop do);
- duckdb: `read_parquet('FOLDER/**/*.parquet')`, a recursive glob.
"""

import json
import sys

import pyarrow.dataset as ds


def main() -> None:
    folder = sys.argv[1].rstrip("/")
    out = {}
    table = ds.dataset(folder, format="parquet").to_table(columns=["id", "prediction"])
    out["pyarrow"] = [
        [i, p] for i, p in zip(table.column("id").to_pylist(), table.column("prediction").to_pylist())
    ]
    try:
        import duckdb
    except ImportError:
        out["duckdb"] = None
    else:
        glob = folder.replace("'", "''") + "/**/*.parquet"
        rows = duckdb.sql(f"select id, prediction from read_parquet('{glob}')").fetchall()
        out["duckdb"] = [[i, p] for i, p in rows]
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
