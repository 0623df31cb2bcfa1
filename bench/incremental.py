"""Issue 35's incremental benchmark: a re-run after 1% new input, against the
first run, with the output a Delta table and `[dataset] incremental = true`.

    python bench/incremental.py data W1_DIR OUT_DIR [--records N] [--files F]
    python bench/incremental.py run BIN_DIR DATA_DIR MODEL WORK_DIR RESULTS [--runs R]
    python bench/incremental.py report RESULTS

`data` tiles W1's records (bench/w1_data.py) into F Parquet objects of N / F
records each (ids `i<file>-<row>`, one row group per object): the pool the
runs draw from. Runs again only when the pool is missing or of another size.

`run` measures, R rounds, two ways of running the nightly job:
- `run --local 2`: the whole `stoke run` command (start-up, plan, work, the
  Delta commit, exit), first over all objects but the last, then again with
  the last one added (1% new input);
- a fleet already up (a coordinator and 2 workers started before): from the
  submit to the manifest's `created_ms` (the job's end), the same two jobs.
Each round starts from an empty table and root. After each round the table
is read with `deltalake`: every record exactly once, or the round fails.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


def make_data(args):
    meta_path = os.path.join(args.out, "pool.json")
    want = {"records": args.records, "files": args.files}
    try:
        with open(meta_path) as f:
            if json.load(f) == want:
                return
    except (OSError, ValueError):
        pass
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    w1 = pq.read_table(os.path.join(args.w1, "data"))
    per = args.records // args.files
    for i in range(args.files):
        start = (i * per) % w1.num_rows
        part = w1.slice(start, min(per, w1.num_rows - start))
        while part.num_rows < per:
            part = pa.concat_tables([part, w1.slice(0, per - part.num_rows)])
        ids = pa.array([f"i{i:03d}-{r}" for r in range(per)])
        part = part.set_column(part.schema.get_field_index("id"), "id", ids)
        pq.write_table(part, os.path.join(args.out, f"part-{i:03d}.parquet"), row_group_size=per)
    with open(meta_path, "w") as f:
        json.dump(want, f)


def spec_text(data_dir, model, table):
    return f"""name = "nightly"
[dataset]
format = "parquet"
uri = "file://{data_dir}/"
id_column = "id"
incremental = true
[processor]
name = "torchscript"
[processor.params]
model = "file://{model}"
input_column = "features"
outputs = ["argmax"]
[batching]
batch_size = 1024
[checkpoint]
interval = 20
[output]
format = "delta"
uri = "file://{table}"
"""


def link_objects(pool, data_dir, names):
    for name in names:
        os.link(os.path.join(pool, name), os.path.join(data_dir, name))


def check_table(table, expected):
    from deltalake import DeltaTable

    t = DeltaTable(table).to_pyarrow_table(columns=["id"])
    distinct = pc.count_distinct(t["id"]).as_py()
    if t.num_rows != expected or distinct != expected:
        sys.exit(f"table {table}: {t.num_rows} rows, {distinct} distinct ids; expected {expected} once each")


def wait_file(path, proc, what, deadline_s=60):
    deadline = time.time() + deadline_s
    while not os.path.exists(path) or os.path.getsize(path) == 0:
        if proc.poll() is not None or time.time() > deadline:
            sys.exit(f"{what} did not start")
        time.sleep(0.02)
    with open(path) as f:
        return f.read().strip()


def manifest_end_ms(root, job):
    path = os.path.join(root, "jobs", job, "manifest.json")
    with open(path) as f:
        return json.load(f)["created_ms"]


def run_local(bin_dir, spec, root, logs):
    started = time.perf_counter()
    out = subprocess.run([os.path.join(bin_dir, "stoke"), "run", spec, "--local", "2", "--root", root],
                         stdout=logs, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        sys.exit(f"stoke run failed: {out.stderr[-2000:]}")
    skipped = [line for line in out.stderr.splitlines() if line.startswith("already done:")]
    return wall, (skipped[0] if skipped else "")


class Fleet:
    """A coordinator and 2 workers, up before any job is submitted."""

    def __init__(self, bin_dir, work, logs):
        self.bin_dir = bin_dir
        self.root = os.path.join(work, "fleet-root")
        addr_file = os.path.join(work, "addr")
        self.procs = [subprocess.Popen(
            [os.path.join(bin_dir, "stoke-coordinator"), "--listen", "127.0.0.1:0", "--http-listen",
             "127.0.0.1:0", "--root", self.root, "--addr-file", addr_file],
            stdout=logs, stderr=subprocess.STDOUT)]
        self.addr = "http://" + wait_file(addr_file, self.procs[0], "the coordinator")
        self.cli = [os.path.join(bin_dir, "stoke"), "--coordinator", self.addr]
        env = dict(os.environ, RUST_LOG="warn")
        for i in range(2):
            self.procs.append(subprocess.Popen(
                [os.path.join(bin_dir, "stoke-worker"), "--coordinator", self.addr, "--worker-id", f"w{i}",
                 "--device", "cpu", "--threads", "1"], stdout=logs, stderr=subprocess.STDOUT, env=env))
        deadline = time.time() + 60
        while len(json.loads(subprocess.run(self.cli + ["workers", "--json"], capture_output=True, text=True,
                                            check=True).stdout)) < 2:
            if time.time() > deadline:
                sys.exit("the workers did not register")
            time.sleep(0.05)

    def job(self, spec):
        """Submits `spec`; the seconds from the submit to the job's end."""
        started_ms = time.time() * 1000
        out = subprocess.run(self.cli + ["submit", spec, "--wait"], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"submit failed: {out.stderr[-2000:]}")
        job = out.stderr.split()[2].rstrip(":")
        skipped = [line for line in out.stderr.splitlines() if line.startswith("already done:")]
        return (manifest_end_ms(self.root, job) - started_ms) / 1000, (skipped[0] if skipped else "")

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(timeout=60)


def run(args):
    names = sorted(n for n in os.listdir(args.data) if n.endswith(".parquet"))
    per_file = pq.ParquetFile(os.path.join(args.data, names[0])).metadata.num_rows
    total = per_file * len(names)
    os.makedirs(args.work, exist_ok=True)
    for rnd in range(1, args.runs + 1):
        for mode in ("local-2", "fleet-up"):
            work = tempfile.mkdtemp(prefix=f"incremental-{mode}-", dir=args.work)
            data_dir, table = os.path.join(work, "data"), os.path.join(work, "table")
            os.makedirs(data_dir)
            spec = os.path.join(work, "job.toml")
            with open(spec, "w") as f:
                f.write(spec_text(data_dir, os.path.abspath(args.model), table))
            logs = open(os.path.join(work, "log.txt"), "w")
            link_objects(args.data, data_dir, names[:-1])
            load = os.getloadavg()[0]
            if mode == "local-2":
                root = os.path.join(work, "root")
                first, _ = run_local(args.bin_dir, spec, root, logs)
                link_objects(args.data, data_dir, names[-1:])
                again, said = run_local(args.bin_dir, spec, root, logs)
            else:
                fleet = Fleet(args.bin_dir, work, logs)
                try:
                    first, _ = fleet.job(spec)
                    link_objects(args.data, data_dir, names[-1:])
                    again, said = fleet.job(spec)
                finally:
                    fleet.stop()
            check_table(table, total)
            result = {"round": rnd, "mode": mode, "objects": len(names), "records": total,
                      "first_s": round(first, 3), "rerun_s": round(again, 3),
                      "ratio": round(again / first, 4), "said": said, "load": round(load, 2)}
            print(json.dumps(result), flush=True)
            with open(args.results, "a") as f:
                f.write(json.dumps(result) + "\n")
            logs.close()
            shutil.rmtree(work, ignore_errors=True)


def report(args):
    with open(args.results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        sys.exit("no results")
    first = rows[0]
    print(f"{first['objects']} objects, {first['records']:,} records; the re-run adds the last object "
          f"({100 / first['objects']:.0f}% new input). {len(rows) // 2} rounds; median (worst).\n")
    print("| how it runs | first run, s | re-run, s | re-run / first | target | met? |")
    print("|---|---:|---:|---:|---:|---|")
    for mode, label in (("local-2", "`stoke run --local 2` (whole command)"),
                        ("fleet-up", "fleet already up (submit to the job's end)")):
        r = [x for x in rows if x["mode"] == mode]
        if not r:
            continue
        ratios = [x["ratio"] for x in r]
        med = statistics.median(ratios)
        print(f"| {label} | {statistics.median(x['first_s'] for x in r):.2f} | "
              f"{statistics.median(x['rerun_s'] for x in r):.2f} | {med:.3f} ({max(ratios):.3f}) | < 0.05 | "
              f"{'met' if max(ratios) < 0.05 else 'missed'} |")
    print(f"\nThe re-runs said: {rows[-1]['said']!r}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("w1")
    d.add_argument("out")
    d.add_argument("--records", type=int, default=2_000_000)
    d.add_argument("--files", type=int, default=100)
    r = sub.add_parser("run")
    r.add_argument("bin_dir")
    r.add_argument("data")
    r.add_argument("model")
    r.add_argument("work")
    r.add_argument("results")
    r.add_argument("--runs", type=int, default=3)
    s = sub.add_parser("report")
    s.add_argument("results")
    args = p.parse_args()
    {"data": make_data, "run": run, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
    # deltalake's runtime threads can abort an interpreter's teardown
    # (delta-rs #2184): the results are written, so leave without it.
    sys.stdout.flush()
    os._exit(0)
