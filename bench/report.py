"""Turns the benchmark's raw results into the markdown report bench/run.sh
prints: the machine, the W1 table (median records/s, min-max, ratios to the
model-only floor (a) and to the plain Python baseline (b), peak memory), the
coordinator scale figures, and each target with met / missed.

    python bench/report.py BENCH_DIR

reads BENCH_DIR/machine.json, w1-results.jsonl, ray-status.txt and
scale-results.txt (each optional) and prints markdown. Only ratios are
compared with targets; nothing here fails on a wall-clock figure.
"""

import json
import os
import re
import statistics
import sys

W1_RECORDS = 200_000

ORDER = [
    ("floor", "(a) model only (TorchScript forward, in-memory tensors)"),
    ("python", "(b) plain Python: pyarrow + torch.jit, 1 process"),
    ("ray-c1", "(c) Ray Data map_batches, actor pool concurrency=1"),
    ("ray-c2", "(c) Ray Data map_batches, actor pool concurrency=2"),
    ("stoke-embedded", "(d) stoke run --embedded --threads 2"),
    ("stoke-local-1", "(e) stoke run --local 1 --device cpu,cpu --threads 1 (2 processors in 1 worker)"),
    ("stoke-local-1-t2", "(e) stoke run --local 1 --threads 2 (1 processor, 2 threads)"),
    ("stoke-local-2", "(e) stoke run --local 2 --threads 1 (per worker)"),
    ("stoke-local-1-nosplit", "(e) as (e) --local 1 --device cpu,cpu, shard splitting off"),
    ("stoke-local-2-nosplit", "(e) as (e) --local 2, shard splitting off"),
    ("stoke-local-2-pt2", "(f) as (e) --local 2, the model as a .pt2 package (AOTInductor)"),
    ("stoke-local-2-base", "(e) as (e) --local 2, with another build (BENCH_BASE_BIN)"),
    ("stoke-local-2-delta", "(i) as (e) --local 2, into a Delta table, one commit at the end"),
    ("stoke-local-2-delta-checkpoint", "(i) as (e) --local 2, into a Delta table, one commit per group"),
    ("stoke-local-2-iceberg", "(j) as (e) --local 2, into an Iceberg table (SQLite catalog), one append at the end"),
    ("stoke-local-2-iceberg-checkpoint", "(j) as (e) --local 2, into an Iceberg table, one append per group"),
    ("stoke-local-2-python", "(g) as (e) --local 2, through a Python processor (bench/w1_python_processor.py)"),
    ("stoke-local-1-python", "(g) as (e) --local 1 --device cpu,cpu, Python processors sharing one GIL"),
    ("stoke-fleet-2", "(h) stoke submit --wait to a fleet already up (coordinator + 2 workers, 1 thread each)"),
    ("stoke-fleet-2-python", "(h) as (h), through the Python processor (workers started with --python-prewarm)"),
]


def load_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fmt_rate(x):
    return f"{x:,.0f}"


def python_ratios(med, by, builtin, py, what):
    """The Python processor's targets: >= 0.9x the built-in runner, >= 1.5x
    plain Python; for jobs on a fleet already up, also in the job's own
    time (`stoke report`'s wall_s), which the 200 ms poll of `submit
    --wait` does not blur."""
    ratio = med[py] / med[builtin]
    line = f"{what}: {ratio:.2f}x records/s (target >= 0.9x: {'met' if ratio >= 0.9 else 'missed'})"
    if med.get("python"):
        vs_py = med[py] / med["python"]
        line += f"; / plain Python (b): {vs_py:.2f}x (target >= 1.5x: {'met' if vs_py >= 1.5 else 'missed'})"
    jobs = job_rate(by[py]), job_rate(by[builtin])
    if builtin.startswith("stoke-fleet") and all(jobs):
        job_ratio = jobs[0] / jobs[1]
        line += (
            f"; in the job's own time: {job_ratio:.2f}x ({fmt_rate(jobs[0])} against "
            f"{fmt_rate(jobs[1])} records/s; target >= 0.9x: {'met' if job_ratio >= 0.9 else 'missed'})"
        )
    return line + "."


def w1_section(bench_dir):
    rows = load_jsonl(os.path.join(bench_dir, "w1-results.jsonl"))
    if not rows:
        return ["_W1 was not run._"], {}, {}
    by = {}
    for r in rows:
        by.setdefault(r["contender"], []).append(r)
    med = {c: statistics.median(r["records_per_s"] for r in rs) for c, rs in by.items()}
    floor = med.get("floor")
    base = med.get("python")
    runs = max(len(rs) for rs in by.values())
    out = [
        f"W1: {W1_RECORDS:,} records x 256 float32 in 8 Parquet files, TorchScript MLP "
        f"256-512-512-10, batch 1024, outputs to Parquet; {runs} runs per contender, "
        "contenders interleaved round by round. records/s = 200,000 / wall time of the "
        "whole command (start-up, model load, reading, writing, exit), except (a), which "
        "times only its forward passes. Every run's output was checked to hold 200,000 rows.",
        "",
        "| contender | records/s (median) | min - max | x (a) | x (b) | wall s (median) "
        "| records/s excl. start-up | records/s, job phase | job phase x (a) "
        "| peak RSS, process tree (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, label in ORDER:
        rs = by.get(key)
        if not rs:
            continue
        rates = [r["records_per_s"] for r in rs]
        m = med[key]
        inner = [r["inner_s"] for r in rs if "inner_s" in r]
        inner_rate = fmt_rate(W1_RECORDS / statistics.median(inner)) if inner else "-"
        if key == "floor":
            inner_rate = "-"
        job = job_rate(rs)
        job_cells = f"{fmt_rate(job) if job else '-'} | {f'{job / floor:.2f}' if job and floor else '-'}"
        out.append(
            f"| {label} | {fmt_rate(m)} | {fmt_rate(min(rates))} - {fmt_rate(max(rates))} "
            f"| {m / floor:.2f} | {m / base:.2f} | {statistics.median(r['wall_s'] for r in rs):.2f} "
            f"| {inner_rate} | {job_cells} | {statistics.median(r['peak_tree_rss_mib'] for r in rs):,.0f} |"
            if floor and base
            else f"| {label} | {fmt_rate(m)} | {fmt_rate(min(rates))} - {fmt_rate(max(rates))} "
            f"| - | - | - | {inner_rate} | {job_cells} | - |"
        )
    out.append("")
    if med.get("stoke-local-2") and med.get("stoke-local-2-pt2"):
        ts_job, pt2_job = job_rate(by["stoke-local-2"]), job_rate(by["stoke-local-2-pt2"])
        job_ratio = f"{pt2_job / ts_job:.2f}x" if ts_job and pt2_job else "n/a"
        out += [
            f"The model as a .pt2 package vs as TorchScript (f) / (e) --local 2: "
            f"{med['stoke-local-2-pt2'] / med['stoke-local-2']:.2f}x records/s (median, whole "
            f"command), {job_ratio} in the job phase.",
            "",
        ]
    # (this, against): this build vs the base build, a Delta table vs
    # Parquet objects.
    for this, against, what in (
        ("stoke-local-2", "stoke-local-2-base", "This build vs the base build (BENCH_BASE_BIN)"),
        ("stoke-local-2-delta", "stoke-local-2", "Delta table (commit = end) vs Parquet objects"),
        ("stoke-local-2-delta-checkpoint", "stoke-local-2", "Delta table (commit = checkpoint) vs Parquet objects"),
        ("stoke-local-2-iceberg", "stoke-local-2", "Iceberg table (commit = end) vs Parquet objects"),
        ("stoke-local-2-iceberg-checkpoint", "stoke-local-2", "Iceberg table (commit = checkpoint) vs Parquet objects"),
    ):
        if med.get(this) and med.get(against):
            jobs = job_rate(by[this]), job_rate(by[against])
            job_part = f", {jobs[0] / jobs[1]:.2f}x in the job phase" if all(jobs) else ""
            out += [
                f"{what}, --local 2: {med[this] / med[against]:.2f}x records/s (median, whole command){job_part}.",
                "",
            ]
    for n in ("1", "2"):
        on, off = f"stoke-local-{n}", f"stoke-local-{n}-nosplit"
        if med.get(on) and med.get(off):
            jobs = job_rate(by[on]), job_rate(by[off])
            job_part = f", {jobs[0] / jobs[1]:.2f}x in the job phase" if all(jobs) else ""
            out += [
                f"Shard splitting on / off, --local {n}: {med[on] / med[off]:.2f}x records/s "
                f"(median, whole command){job_part}.",
                "",
            ]
    for builtin, py, what in [
        ("stoke-local-2", "stoke-local-2-python", "Python processor (g) / built-in runner (e) --local 2"),
        ("stoke-fleet-2", "stoke-fleet-2-python", "On a fleet already up (h): Python processor / built-in runner"),
    ]:
        if med.get(builtin) and med.get(py):
            out += [python_ratios(med, by, builtin, py, what), ""]
    if med.get("stoke-local-1") and med.get("stoke-local-1-python"):
        out += [
            f"Two Python processors in one worker (one GIL) vs two Rust ones: "
            f"{med['stoke-local-1-python'] / med['stoke-local-1']:.2f}x records/s.",
            "",
        ]
    out.append(
        "records/s excl. start-up: (b) from after its imports; (c) from after ray.init "
        "(ray.init itself: median "
        + (
            f"{statistics.median(r['init_s'] for k in ('ray-c1', 'ray-c2') for r in by.get(k, []) if 'init_s' in r):.1f} s"
            if any("init_s" in r for k in ("ray-c1", "ray-c2") for r in by.get(k, []))
            else "n/a"
        )
        + "); (d) and (e) the `took` the CLI prints ((e): from the workers' start, after "
        "the coordinator planned the job). records/s, job phase: (d) and (e) from the "
        "first lease a worker took to the last shard committed (the workers' log lines): "
        "the job itself, with the model's load and warm-up, every read, write and commit, "
        "but not process start-up (libtorch's static initialisers, about 0.3 s per "
        "process here) or exit; like (a), which times only its forward passes. "
        "Peak RSS: sum over the command and every "
        "process it started (Ray's daemons and actors, stoke's workers), sampled every 100 ms."
    )
    ray_status = os.path.join(bench_dir, "ray-status.txt")
    if os.path.exists(ray_status):
        with open(ray_status) as f:
            status = f.read().strip()
        if status:
            out += ["", f"Ray Data: {status}"]
    stages = []
    for key, label in ORDER:
        rs = [r for r in by.get(key, []) if r.get("stages")]
        if not rs:
            continue
        def mid(field):
            return statistics.median(r["stages"].get(field, 0) for r in rs) / 1e3
        stages.append(
            f"| {label} | {mid('model_ms'):.2f} | {mid('input_wait_ms'):.2f} | {mid('checkpoint_ms'):.2f} "
            f"| {statistics.median(r.get('inner_s', 0) for r in rs):.2f} |"
        )
    if stages:
        out += [
            "",
            "Where stoke's time goes (medians over runs; seconds summed over all shard "
            "attempts, from the workers' `attempt stage times` log lines; with 2 workers "
            "the sums cover both, so they can exceed the wall time):",
            "",
            "| contender | model | waiting for input | checkpoint (write + upload + commit) | took |",
            "|---|---:|---:|---:|---:|",
            *stages,
        ]
    return out, med, by


def job_rate(rows):
    """Median records/s over the job phase of the rows that have one."""
    jobs = [r["job_s"] for r in rows if r.get("job_s")]
    return W1_RECORDS / statistics.median(jobs) if jobs else None


def targets_w1(med, by):
    floor, base = med.get("floor"), med.get("python")
    rays = [med[k] for k in ("ray-c1", "ray-c2") if k in med]
    ray = max(rays) if rays else None
    out = []
    for key in ("stoke-local-1", "stoke-local-2"):
        if key not in med or not floor or not base:
            continue
        e = med[key]
        checks = []
        job = job_rate(by.get(key, []))
        if job:
            checks.append(("x floor (a) >= 0.8, job phase (like (a): no process start-up)", job / floor, 0.8))
        checks += [
            ("x floor (a) >= 0.8, whole command (start-up and exit included; (a) has neither)", e / floor, 0.8),
            ("x Python (b) >= 1.5", e / base, 1.5),
        ]
        if ray:
            checks.append(("x Ray Data (c, best) >= 7", e / ray, 7.0))
        for name, value, want in checks:
            out.append(f"| {key} | {name} | {value:.2f} | {'met' if value >= want else 'missed'} |")
        if not ray:
            out.append(f"| {key} | x Ray Data (c) >= 7 | n/a | not measured (see above) |")
    return out


def scale_section(bench_dir):
    path = os.path.join(bench_dir, "scale-results.txt")
    if not os.path.exists(path):
        return ["_The coordinator scale benchmark was not run._"], []
    with open(path) as f:
        lines = [l.strip() for l in f if l.startswith("scale ")]
    kinds = {"cycles": [], "plan": [], "acquire": [], "finish": [], "ended": []}
    for line in lines:
        kind = line.split()[1]
        if kind in kinds:
            kinds[kind].append(dict(re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", line)))
    cycles, plans = kinds["cycles"], kinds["plan"]
    out = [
        "Simulated workers in one process (each its own session stream; 50 workers share "
        "one HTTP/2 channel, as the workers of one node would) loop AcquireLease -> "
        "Commit(shard_done) against a real `stoke-coordinator` process on a file store; "
        "one fresh coordinator per worker count, a `range` job of 400,000 shards (more than "
        "a run completes), coordinator log level warn. Unless pinned (the CPUs column), the "
        "simulated workers share the machine's cores with the coordinator.",
        "",
        "| jobs | coordinator CPUs | workers | channels | cycles/s | cycle p50 ms | cycle p99 ms | AcquireLease p50 ms "
        "| Commit p50 ms | coordinator CPU (cores) | simulated workers' CPU (cores) "
        "| coordinator RSS MiB | errors | cycles in each second of the run |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cycles:
        out.append(
            f"| {c.get('jobs', '1')} | {c.get('coordinator_cpus', 'all')} | {c['workers']} | {c['channels']} | {float(c['cycles_per_s']):,.0f} | {c['p50_ms']} "
            f"| {c['p99_ms']} | {c['acquire_p50_ms']} | {c['commit_p50_ms']} "
            f"| {c['coordinator_cpu_cores']} | {c['client_cpu_cores']} | {c['coordinator_rss_mib']} "
            f"| {c['errors']} | {c['per_second'].replace(',', ', ')} |"
        )
    for p in plans:
        out += [
            "",
            f"Plan: a `range` job with {int(p['shards']):,} shards: Submit answered in "
            f"{p['submit_s']} s; coordinator RSS {p['rss_before_mib']} MiB before, "
            f"{p['rss_after_mib']} MiB after (peak {p['rss_peak_mib']} MiB); plan.json "
            f"{p['plan_json_mib']} MiB; one GetJob afterwards took {p['get_job_ms']} ms.",
        ]
    if kinds["acquire"]:
        out += [
            "",
            "The acquire path alone (the state machine in process, no gRPC, no store; "
            "release -> acquire with 1,000 sessions holding leases):",
            "",
            "| jobs | jobs ended before | release -> acquire per s | us per cycle |",
            "|---:|---:|---:|---:|",
        ]
        for a in kinds["acquire"]:
            out.append(
                f"| {a['jobs']} | {a.get('ended', '0')} | {float(a['release_acquire_per_s']):,.0f} | {a['us_per_cycle']} |"
            )
    for e in kinds["ended"]:
        out += [
            "",
            f"{e['jobs']} jobs of {int(e['shards']):,} shards, one after another: the coordinator's "
            f"RSS (MiB) after each {e['rss_mib'].replace(',', ', ')}; shards held after each "
            f"{e['shards_in_memory'].replace(',', ', ')}; another coordinator on the root was ready "
            f"in {e.get('restart_s', 'n/a')} s at {e.get('rss_after_restart_mib', 'n/a')} MiB.",
        ]
    for f in kinds["finish"]:
        out += [
            "",
            f"A {int(f['shards']):,}-shard job finishing beside a running one: finish took "
            f"{f['finish_s']} s; the running job's commits p50 {f['during_p50_ms']} ms, "
            f"p99 {f['during_p99_ms']} ms, max {f['during_max_ms']} ms during it, "
            f"p50 {f['after_p50_ms']} ms after; errors {f['errors']}.",
        ]
    targets = []
    for c in cycles:
        if c["workers"] != "1000":
            continue
        v = float(c["cycles_per_s"])
        jobs = c.get("jobs", "1")
        cpus = c.get("coordinator_cpus", "all")
        where = "sharing the machine" if cpus == "all" else f"on CPUs {cpus} of its own"
        targets.append(
            f"| coordinator | cycles/s at {jobs} job(s) x 1,000 workers >= 10,000 (coordinator {where}) "
            f"| {v:,.0f} | {'met' if v >= 10_000 else 'missed'} |"
        )
    for p in plans:
        if p["shards"] == "1000000":
            v = float(p["rss_peak_mib"])
            targets.append(
                f"| coordinator | 1M shards in < 1 GiB (peak RSS) | {v:,.0f} MiB | {'met' if v < 1024 else 'missed'} |"
            )
    return out, targets


def main():
    bench_dir = sys.argv[1]
    machine = {}
    mpath = os.path.join(bench_dir, "machine.json")
    if os.path.exists(mpath):
        with open(mpath) as f:
            machine = json.load(f)
    out = ["## Machine", ""]
    for k, v in machine.items():
        out.append(f"- {k}: {v}")
    w1, med, by = w1_section(bench_dir)
    out += ["", "## W1: end to end", ""] + w1
    scale, scale_targets = scale_section(bench_dir)
    out += ["", "## Coordinator scale", ""] + scale
    rows = targets_w1(med, by) + scale_targets
    if rows:
        out += ["", "## Targets", "", "| who | target | measured | |", "|---|---|---:|---|"] + rows
    print("\n".join(out))


if __name__ == "__main__":
    main()
