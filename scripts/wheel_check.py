#!/usr/bin/env python3
"""Checks a job's committed outputs hold every record of its dataset
exactly once (scripts/wheel-test.sh and scripts/image.sh run it, with the
stoke venv's python, on jobs run by an installed wheel or an image).

Usage: wheel_check.py OUTPUTS DATASET [ID_COLUMN]

OUTPUTS is the job's output folder (Parquet, read as a dataset the way
users read it: files whose names start with `_` or `.` are skipped);
DATASET is the input's Parquet folder. Every id of DATASET's ID_COLUMN
(default `id`) must appear once in OUTPUTS's `id` column, and no other id.
Prints one line, `N records, each exactly once`, or exits 1 naming the
first ids missing, repeated or unknown.
"""

import collections
import sys

import pyarrow.dataset as ds


def ids(folder: str, column: str) -> list[str]:
    table = ds.dataset(folder, format="parquet").to_table(columns=[column])
    return [str(v) for v in table.column(column).to_pylist()]


def main() -> int:
    if len(sys.argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    outputs, dataset = sys.argv[1], sys.argv[2]
    column = sys.argv[3] if len(sys.argv) == 4 else "id"
    want = set(ids(dataset, column))
    got = collections.Counter(ids(outputs, "id"))
    missing = sorted(want - set(got))
    repeated = sorted(i for i, n in got.items() if n > 1)
    unknown = sorted(set(got) - want)
    if missing or repeated or unknown:
        print(
            f"{outputs}: {len(missing)} missing (first {missing[:5]}), "
            f"{len(repeated)} repeated (first {repeated[:5]}), "
            f"{len(unknown)} unknown (first {unknown[:5]}) of {len(want)} records",
            file=sys.stderr,
        )
        return 1
    print(f"{len(want)} records, each exactly once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
