"""Checks one benchmark run's output and appends its figures to the results
file (JSON Lines). Exits non-zero, saying why, when the run failed or its
output does not hold every record exactly as many times as W1 has records.

    python bench/record.py --results R.jsonl --contender NAME --kind KIND \
        --round N --measure M.json --stdout OUT.log --stderr ERR.log \
        [--out-dir DIR] [--expect 200000]

KIND: floor (records/s from the script's own timing of the forward passes),
python and ray (rows counted in the Parquet files under --out-dir), stoke
(the manifest's records_out, at the path the CLI prints after `manifest: `,
and the rows of the Parquet files under the printed `outputs: ` folder;
also the job phase, first lease to last committed shard, from the workers'
log lines).
"""

import argparse
import datetime
import glob
import json
import os
import re
import sys

import pyarrow.parquet as pq


def parquet_rows(folder):
    files = glob.glob(os.path.join(folder, "**", "*.parquet"), recursive=True)
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files), len(files)


def result_line(text):
    """key=value pairs of the last `result ...` line a script printed."""
    lines = [l for l in text.splitlines() if l.startswith("result ")]
    if not lines:
        return {}
    return dict(kv.split("=", 1) for kv in lines[-1].split()[1:])


def printed(text, label):
    m = re.search(rf"^{label}: (.+)$", text, re.M)
    return m.group(1).strip() if m else None


def stage_times(stderr):
    """Sums the workers' `attempt stage times` log lines (stoke_worker=info)."""
    totals = {}
    for line in stderr.splitlines():
        if "attempt stage times" not in line:
            continue
        for key in ("batches", "records", "input_wait_ms", "model_ms", "checkpoint_ms"):
            m = re.search(rf"\b{key}=(\d+)", line)
            if m:
                totals[key] = totals.get(key, 0) + int(m.group(1))
    return totals


def job_phase_seconds(stderr):
    """Seconds from the first `lease taken` to the last `shard finished` in
    the workers' logs (stoke_worker=info): the job itself, without process
    start-up (libtorch's initialisers, connecting) or exit. None when the
    lines are missing."""
    stamps = {"lease taken": [], "shard finished": []}
    for line in stderr.splitlines():
        for key, found in stamps.items():
            if key in line:
                # `stoke run --local` prefixes each worker's lines with
                # `[local-N] `.
                m = re.match(r"(?:\[[^\]]*\] )?(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z", line)
                if m:
                    found.append(datetime.datetime.fromisoformat(m.group(1)))
    if not stamps["lease taken"] or not stamps["shard finished"]:
        return None
    return (max(stamps["shard finished"]) - min(stamps["lease taken"])).total_seconds()


def fail(msg):
    print(f"bench: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--results", required=True)
    p.add_argument("--contender", required=True)
    p.add_argument("--kind", required=True, choices=["floor", "python", "ray", "stoke"])
    p.add_argument("--round", type=int, required=True)
    p.add_argument("--measure", required=True)
    p.add_argument("--stdout", required=True)
    p.add_argument("--stderr", required=True)
    p.add_argument("--out-dir")
    p.add_argument("--expect", type=int, default=200_000)
    args = p.parse_args()

    with open(args.measure) as f:
        m = json.load(f)
    with open(args.stdout, errors="replace") as f:
        out = f.read()
    with open(args.stderr, errors="replace") as f:
        err = f.read()
    where = f"{args.contender} round {args.round} (logs: {args.stdout}, {args.stderr})"
    if m["rc"] != 0:
        tail = "\n".join(err.splitlines()[-15:])
        fail(f"{where} exited with {m['rc']}:\n{tail}")

    row = {
        "contender": args.contender,
        "kind": args.kind,
        "round": args.round,
        "wall_s": m["wall_s"],
        "peak_tree_rss_mib": m["peak_tree_rss_mib"],
        "peak_proc_rss_mib": m["peak_proc_rss_mib"],
    }
    res = result_line(out)
    if args.kind == "floor":
        if int(res.get("records", 0)) != args.expect:
            fail(f"{where}: the floor ran {res.get('records')} records, expected {args.expect}")
        row["records_per_s"] = float(res["records_per_s"])
        row["inner_s"] = float(res["seconds"])
    elif args.kind in ("python", "ray"):
        rows, files = parquet_rows(args.out_dir)
        if rows != args.expect:
            fail(f"{where}: {rows} rows in {files} Parquet files under {args.out_dir}, expected {args.expect}")
        row["records_per_s"] = args.expect / m["wall_s"]
        if "seconds" in res:
            row["inner_s"] = float(res["seconds"])
        if "init_seconds" in res:
            row["init_s"] = float(res["init_seconds"])
    else:
        manifest = printed(out, "manifest")
        outputs = printed(out, "outputs")
        if not manifest or not os.path.exists(manifest):
            fail(f"{where}: the CLI printed no manifest path (or it does not exist)")
        with open(manifest) as f:
            records_out = json.load(f).get("records_out")
        if records_out != args.expect:
            fail(f"{where}: manifest {manifest} says records_out={records_out}, expected {args.expect}")
        rows, files = parquet_rows(outputs)
        if rows != args.expect:
            fail(f"{where}: {rows} rows in {files} Parquet files under {outputs}, expected {args.expect}")
        row["records_per_s"] = args.expect / m["wall_s"]
        row["output_files"] = files
        took = re.search(r"^took ([0-9.]+)s$", err, re.M)
        if took:
            row["inner_s"] = float(took.group(1))
        stages = stage_times(err)
        if stages:
            row["stages"] = stages
        job_s = job_phase_seconds(err)
        if not job_s:
            # A job submitted to a fleet: its own time from `stoke report`.
            found = re.search(r'"wall_s":\s*([0-9.]+)', out)
            job_s = float(found.group(1)) if found else None
        if job_s:
            row["job_s"] = round(job_s, 4)
    with open(args.results, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(
        f"bench: {args.contender:<22} round {args.round}: {row['records_per_s']:>9.0f} records/s"
        f"  (wall {m['wall_s']:.2f}s, peak RSS {row['peak_tree_rss_mib']:.0f} MiB)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
