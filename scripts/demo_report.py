#!/usr/bin/env python3
"""Check a finished stoke demo job and summarise it.

Usage: demo_report.py MANIFEST_PATH DIGITS_DIR [TEST_IDS_FILE]

MANIFEST_PATH is the job manifest stoke writes when a job commits (JSON with
records_in, records_out, shards and outputs: [{shard_id, uri, records, bytes, sha256}]).
DIGITS_DIR holds the input Parquet files (columns id, label); TEST_IDS_FILE, if given,
lists the held-out ids, one per line.

Checks that every listed output file exists with the manifest's size, sha256 and row
count, and that every input id appears exactly once in the outputs (none missing, none
duplicated, none unknown). Prints a short summary with the accuracy; exits 1 if any
check fails, 2 on bad usage or unreadable inputs.
"""

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import unquote, urlparse

PREDICTION_COLUMNS = ("prediction", "argmax")


def die(msg: str, code: int = 2) -> None:
    print(f"demo_report: {msg}", file=sys.stderr)
    sys.exit(code)


def uri_to_path(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            die(f"output uri {uri!r} names host {parsed.netloc!r}; only local file:// URIs are supported")
        return Path(unquote(parsed.path))
    if parsed.scheme == "":
        return Path(uri)
    die(f"output uri {uri!r}: unsupported scheme {parsed.scheme!r} (expected file://)")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parquet_files(path: Path) -> list:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".parquet")
        if not files:
            die(f"no .parquet files in {path}")
        return files
    if path.is_file():
        return [path]
    die(f"no such file or folder: {path}")


def main() -> None:
    if len(sys.argv) not in (3, 4) or sys.argv[1] in ("-h", "--help"):
        print("usage: demo_report.py MANIFEST_PATH DIGITS_DIR [TEST_IDS_FILE]", file=sys.stderr)
        sys.exit(2)
    manifest_path = Path(sys.argv[1]).resolve()
    digits_dir = Path(sys.argv[2])
    test_ids_file = Path(sys.argv[3]) if len(sys.argv) == 4 else None

    import pyarrow.parquet as pq

    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        die(f"cannot read manifest {manifest_path}: {e}")
    outputs = manifest.get("outputs")
    if not isinstance(outputs, list):
        die(f"manifest {manifest_path} has no 'outputs' list")

    problems = []

    # 1. Each listed file: present, right size, right checksum, right row count.
    ids, preds = [], []
    checksums_ok = True
    for i, out in enumerate(outputs):
        try:
            uri = out["uri"]
        except (TypeError, KeyError):
            die(f"manifest output #{i} has no 'uri'")
        name = out.get("shard_id", f"#{i}")
        path = uri_to_path(uri)
        if not path.is_file():
            problems.append(f"output {name}: missing file {path}")
            checksums_ok = False
            continue
        size = path.stat().st_size
        if "bytes" in out and out["bytes"] != size:
            problems.append(f"output {name}: {path} has {size} bytes, manifest says {out['bytes']}")
            checksums_ok = False
        digest = sha256_of(path)
        if str(out.get("sha256", "")).lower() != digest:
            problems.append(f"output {name}: sha256 mismatch for {path} "
                            f"(file {digest[:16]}..., manifest {str(out.get('sha256'))[:16]}...)")
            checksums_ok = False
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - report any unreadable file the same way
            problems.append(f"output {name}: cannot read {path} as Parquet: {e}")
            checksums_ok = False
            continue
        if "records" in out and pf.metadata.num_rows != out["records"]:
            problems.append(f"output {name}: {path} has {pf.metadata.num_rows} rows, "
                            f"manifest says {out['records']}")
            checksums_ok = False
        cols = pf.schema_arrow.names
        pred_col = next((c for c in PREDICTION_COLUMNS if c in cols), None)
        if "id" not in cols or pred_col is None:
            problems.append(f"output {name}: {path} lacks an id or prediction column (columns: {', '.join(cols)})")
            continue
        table = pf.read(columns=["id", pred_col])
        ids.extend(str(v) if v is not None else None for v in table.column("id").to_pylist())
        preds.extend(table.column(pred_col).to_pylist())

    if "records_out" in manifest and manifest["records_out"] != sum(int(o.get("records", 0)) for o in outputs):
        problems.append(f"manifest records_out {manifest['records_out']} != sum of its outputs' records "
                        f"{sum(int(o.get('records', 0)) for o in outputs)}")

    # 2. The inputs and their labels.
    labels = {}
    for path in parquet_files(digits_dir):
        table = pq.read_table(path, columns=["id", "label"])
        for rid, label in zip(table.column("id").to_pylist(), table.column("label").to_pylist()):
            labels[str(rid)] = label
    if "records_in" in manifest and manifest["records_in"] != len(labels):
        problems.append(f"manifest records_in {manifest['records_in']} != {len(labels)} input records")

    # 3. Exactly once.
    counts = Counter(ids)
    missing = sum(1 for rid in labels if rid not in counts)
    duplicated = sum(1 for rid, c in counts.items() if c > 1)
    unknown = sum(1 for rid in counts if rid not in labels)
    if missing:
        sample = ", ".join(sorted(rid for rid in labels if rid not in counts)[:3])
        problems.append(f"{missing} input records missing from the outputs (e.g. {sample})")
    if duplicated:
        sample = ", ".join(sorted(rid for rid, c in counts.items() if c > 1)[:3])
        problems.append(f"{duplicated} records appear more than once in the outputs (e.g. {sample})")
    if unknown:
        sample = ", ".join(sorted(str(rid) for rid in counts if rid not in labels)[:3])
        problems.append(f"{unknown} output ids are not in the inputs (e.g. {sample})")

    # 4. Accuracy (first prediction per id).
    pred_by_id = {}
    for rid, p in zip(ids, preds):
        pred_by_id.setdefault(rid, p)
    scored = [rid for rid in labels if rid in pred_by_id]
    correct = sum(1 for rid in scored if pred_by_id[rid] == labels[rid])
    acc_line = f"accuracy: {correct / len(scored):.3f} on all {len(scored)} images" if scored else "accuracy: n/a"
    if test_ids_file is not None:
        try:
            test_ids = [line.strip() for line in test_ids_file.read_text().splitlines() if line.strip()]
        except OSError as e:
            die(f"cannot read test ids {test_ids_file}: {e}")
        held = [rid for rid in test_ids if rid in pred_by_id and rid in labels]
        if held:
            held_correct = sum(1 for rid in held if pred_by_id[rid] == labels[rid])
            acc_line += f", {held_correct / len(held):.3f} on {len(held)} held-out images"

    n_files = len(outputs)
    print(f"stoke demo: {len(ids)} records classified in {n_files} output file{'s' if n_files != 1 else ''}")
    once = "yes" if not (missing or duplicated or unknown) else "NO"
    extra = f", {unknown} unknown" if unknown else ""
    print(f"exactly once: {once} ({missing} missing, {duplicated} duplicated{extra}); "
          f"checksums: {'ok' if checksums_ok else 'FAILED'}")
    print(acc_line)
    print(f"manifest: {manifest_path}")
    if problems:
        print("FAILED:", file=sys.stderr)
        for p in problems[:20]:
            print(f"  {p}", file=sys.stderr)
        if len(problems) > 20:
            print(f"  ... and {len(problems) - 20} more", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
