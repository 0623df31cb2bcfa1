"""The straggler workload: W1's data through a heavier model on a fleet of
workers where one runs at a fraction of the others' speed.

The slow worker is slowed for real, from outside: a thread here stops it
(SIGSTOP) and lets it run (SIGCONT) in 40 ms cycles (`--cycle-ms`),
running `--duty` of each. The duty cycles share one clock: the fast workers run in turns and
the slow one beside the first, so on this 2-core machine no two workers
wait for the same core (which measuring each alone would not see). Nothing
inside stoke or Ray sleeps. With `--slow-by quota` the slow worker is
slowed by CPU contention instead: it runs in a cgroup whose CPU quota is
`--duty` of one core, so the kernel throttles it (between its stages as
much as inside them) while the others run free. With `--fast-by quota`
and `--fast-duty` below 1, each fast worker runs in a cgroup of its own
with a CPU quota of `--fast-duty` of a core: a CPU budget per worker, as
on separate machines, instead of the fast workers filling this machine's
2 cores (where any third process, even one that never gets work, takes
CPU from them: see `--control`).

    python bench/straggler.py stoke BIN_DIR DATA_DIR MODEL WORK --workers 3 --slow 1 --split on
    python bench/straggler.py ray DATA_DIR MODEL WORK --workers 3 --slow 1
    python bench/straggler.py model MODEL_PATH      # writes the heavier model
    python bench/straggler.py jsonl W1_DATA OUT_DIR # 36,000 of W1's records as JSON Lines
    python bench/straggler.py summary RESULTS.jsonl # the markdown table
    python bench/straggler.py ratios RESULTS.jsonl  # the late-start table

`stoke` starts a coordinator and `--workers` worker processes (1 thread
each), `--slow` of them slowed, submits the job (shard splitting on or
off) and times it from submit to success; then reads `stoke report --json`.
With `--start fleet-up` (the default) the workers are up and registered
before the submit, as on a cluster, so no process start is in the time;
`--start with-job` starts them with the job; `--start after-submit` starts
them just after the submit, with `--exit-when-idle`, as a fleet scaling up
for a job does (their process start is in the job's time, and the slow
one is slowed from its first instruction). `--control` points the slow
workers at no coordinator: they start, slowed the same way, and never get
work, which measures what their processes alone cost the others.
`--workers 1` measures one worker's throughput alone (slow or not), for the
ideal. `ray` runs Ray Data's map_batches over an actor pool of `--workers`
actors (1 thread, 1 CPU each), the first `--slow` actors duty-cycled.

Prints one JSON line: contender, seconds, records, and for stoke the
report's causes and processor seconds.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pyarrow.parquet as pq

CYCLE_S = 0.040
# Small batches and a checkpoint every 2: what a split leaves its holder (a
# checkpoint interval and one batch) is short against a 25,000-record shard.
BATCH = 256
# The late-start job: 36,000 records of W1 as JSON Lines, in 2 files (a
# shard each, at the default 64 MiB a shard).
JSONL_RECORDS = 36_000
JSONL_FILES = 2
# A cgroup's CPU period, for `--slow-by quota`.
QUOTA_PERIOD_US = 100_000


def set_cycle(ms):
    """The duty cycles' period (`--cycle-ms`)."""
    global CYCLE_S
    CYCLE_S = ms / 1000


class DutyCycle:
    """Runs `pid` for `duty` of every cycle (`CYCLE_S`, 40 ms unless
    `--cycle-ms` says otherwise) until stopped, starting at
    `phase` (a share of the cycle) into each cycle of a clock shared by all
    the duty cycles: the fast workers run in turns and the slow one beside
    the first, so no two of them wait for the same core (3 workers on this
    machine's 2 cores would otherwise slow each other where their runs
    overlap, which measuring each alone does not see)."""

    EPOCH = time.monotonic()

    def __init__(self, pid, duty, phase=0.0):
        self.pid = pid
        self.duty = duty
        self.phase = phase
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def sleep_until(self, t):
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def run(self):
        k = int((time.monotonic() - self.EPOCH) / CYCLE_S) + 1
        try:
            os.kill(self.pid, signal.SIGSTOP)
            while not self.done.is_set():
                start = self.EPOCH + (k + self.phase) * CYCLE_S
                self.sleep_until(start)
                os.kill(self.pid, signal.SIGCONT)
                self.sleep_until(start + self.duty * CYCLE_S)
                os.kill(self.pid, signal.SIGSTOP)
                k += 1
        except ProcessLookupError:
            return

    def stop(self):
        self.done.set()
        self.thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def phases(n_workers, n_slow, fast_duty):
    """Each worker's phase: the fast ones one after another, the slow ones
    from the start of the cycle (beside the first fast one)."""
    out = []
    for i in range(n_workers):
        out.append(0.0 if i < n_slow else ((i - n_slow) * fast_duty) % 1.0)
    return out


def wait_file(path, proc, what):
    deadline = time.time() + 60
    while time.time() < deadline:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path) as f:
                return f.read().strip()
        if proc.poll() is not None:
            sys.exit(f"{what} exited before it was ready")
        time.sleep(0.01)
    sys.exit(f"{what} not ready within 60 s")


def spec_text(data_dir, model, split, fmt="parquet", backup=True):
    # Parquet: shards of 25,000 records (one file each); JSON Lines: the
    # default shard size in bytes (one file each here).
    records = "records = 25000\n" if fmt == "parquet" else ""
    return f"""name = "straggler"
[dataset]
format = "{fmt}"
uri = "file://{data_dir}/"
id_column = "id"
[processor]
name = "torchscript"
[processor.params]
model = "file://{model}"
input_column = "features"
outputs = ["argmax"]
[batching]
batch_size = {BATCH}
[checkpoint]
interval = 2
[sharding]
{records}split = {"true" if split else "false"}
backup = {"true" if backup else "false"}
[output]
format = "parquet"
"""


def make_jsonl(w1_data, out_dir):
    """The first JSONL_RECORDS records of W1 (ids and features, 4 decimals:
    the plan counts the lines of files up to 128 MiB in all, which a split
    needs) in JSONL_FILES files. Idempotent."""
    # Beside the folder: a .json file in it would be read as data.
    marker = out_dir.rstrip("/") + ".done"
    want = {"records": JSONL_RECORDS, "files": JSONL_FILES, "source": os.path.abspath(w1_data)}
    if os.path.exists(marker) and json.load(open(marker)) == want:
        return
    os.makedirs(out_dir, exist_ok=True)
    names = sorted(f for f in os.listdir(w1_data) if f.endswith(".parquet"))
    rows = []
    for name in names:
        table = pq.read_table(os.path.join(w1_data, name), columns=["id", "features"])
        ids = table.column("id").to_pylist()
        feats = table.column("features").combine_chunks().flatten().to_numpy().reshape(len(ids), -1)
        rows.extend(zip(ids, feats))
        if len(rows) >= JSONL_RECORDS:
            break
    rows = rows[:JSONL_RECORDS]
    per = len(rows) // JSONL_FILES
    for f in range(JSONL_FILES):
        part = rows[f * per:(f + 1) * per if f + 1 < JSONL_FILES else len(rows)]
        tmp = os.path.join(out_dir, f".part-{f}.jsonl.tmp")
        with open(tmp, "w") as fh:
            for rid, x in part:
                fh.write(json.dumps({"id": rid, "features": [round(float(v), 4) for v in x]}) + "\n")
        os.replace(tmp, os.path.join(out_dir, f"part-{f}.jsonl"))
    with open(marker, "w") as fh:
        json.dump(want, fh)


class CpuQuota:
    """A cgroup whose processes may run `share` of one CPU (cgroup v1's cpu
    controller, or v2's cpu.max), for a worker slowed by CPU contention."""

    def __init__(self, share, name):
        v1 = "/sys/fs/cgroup/cpu"
        v2 = "/sys/fs/cgroup"
        quota = int(share * QUOTA_PERIOD_US)
        if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
            self.path = os.path.join(v1, name)
            os.makedirs(self.path, exist_ok=True)
            self.write("cpu.cfs_period_us", QUOTA_PERIOD_US)
            self.write("cpu.cfs_quota_us", quota)
        elif "cpu" in open(os.path.join(v2, "cgroup.controllers")).read().split():
            self.path = os.path.join(v2, name)
            os.makedirs(self.path, exist_ok=True)
            self.write("cpu.max", f"{quota} {QUOTA_PERIOD_US}")
        else:
            sys.exit("--slow-by quota needs a writable cgroup cpu controller")
        self.procs = os.path.join(self.path, "cgroup.procs")

    def write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def remove(self):
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def run_stoke(args):
    work = tempfile.mkdtemp(prefix="straggler-", dir=args.work)
    logs = open(os.path.join(work, "log.txt"), "w")
    addr_file = os.path.join(work, "addr")
    bin_dir = args.bin_dir
    coordinator = subprocess.Popen(
        [os.path.join(bin_dir, "stoke-coordinator"), "--listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--root", os.path.join(work, "root"),
         "--addr-file", addr_file],
        stdout=logs, stderr=subprocess.STDOUT)
    addr = "http://" + wait_file(addr_file, coordinator, "the coordinator")
    spec = os.path.join(work, "job.toml")
    with open(spec, "w") as f:
        f.write(spec_text(os.path.abspath(args.data_dir), os.path.abspath(args.model), args.split == "on",
                          args.format, args.backup == "on"))
    cli = [os.path.join(bin_dir, "stoke"), "--coordinator", addr]
    workers = []
    cycles = []
    env = dict(os.environ, RUST_LOG="warn")
    fleet_up = args.start == "fleet-up"
    after_submit = args.start == "after-submit"
    quota = None
    if args.slow and args.slow_by == "quota":
        quota = CpuQuota(args.duty, f"stoke-straggler-{os.getpid()}")
    # A budget per fast worker: a cgroup of its own each.
    fast_quotas = {}
    if args.fast_by == "quota" and args.fast_duty < 1.0:
        for i in range(args.slow, args.workers):
            fast_quotas[i] = CpuQuota(args.fast_duty, f"stoke-straggler-{os.getpid()}-w{i}")
    phase = phases(args.workers, args.slow, args.fast_duty)

    def slow_once_registered(w, worker_id, phase):
        # The coordinator's log says when it registered (read, not asked:
        # a CLI process every few ms would take CPU from the others).
        needle = f"worker registered worker={worker_id} "
        deadline = time.time() + 60
        with open(os.path.join(work, "log.txt"), errors="replace") as log:
            seen = ""
            while time.time() < deadline and w.poll() is None:
                seen = seen[-4096:] + log.read()
                if needle in seen:
                    cycles.append(DutyCycle(w.pid, args.duty, phase))
                    return
                time.sleep(0.002)

    def start_workers():
        for i in range(args.workers):
            cmd = [os.path.join(bin_dir, "stoke-worker"), "--coordinator", addr, "--worker-id", f"w{i}",
                   "--device", "cpu", "--threads", "1"] + ([] if fleet_up else ["--exit-when-idle"])
            slow = i < args.slow
            if slow and args.control:
                # Never reaches the coordinator: what its process alone
                # costs the others.
                cmd[cmd.index(addr)] = "http://127.0.0.1:9"
            cgroup = quota if slow else fast_quotas.get(i)
            if cgroup:
                # In the cgroup before the worker's first instruction.
                cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', cgroup.procs] + cmd
            elif slow and after_submit and args.slow_from == "start":
                # Stopped before the worker's first instruction: its duty
                # cycle lets it go.
                cmd = ["sh", "-c", 'kill -STOP $$ && exec "$@"', "sh"] + cmd
            w = subprocess.Popen(cmd, stdout=logs, stderr=subprocess.STDOUT, env=env)
            workers.append(w)
            if slow and not quota and args.slow_from == "registered" and not args.control:
                # A node that turns slow once it has joined: full speed
                # until the coordinator lists it, a quarter from then on.
                threading.Thread(target=slow_once_registered, args=(w, f"w{i}", phase[i]), daemon=True).start()
            elif slow and not quota:
                cycles.append(DutyCycle(w.pid, args.duty, phase[i]))
            elif not slow and args.fast_duty < 1.0 and i not in fast_quotas:
                cycles.append(DutyCycle(w.pid, args.fast_duty, phase[i]))

    if not after_submit:
        start_workers()
    if fleet_up:
        # A fleet already up, as on a cluster: every worker registered (and
        # idle) before the job is submitted, so no process start is timed.
        deadline = time.time() + 60
        while True:
            listed = json.loads(subprocess.run(cli + ["workers", "--json"], capture_output=True,
                                               text=True, check=True).stdout)
            if len(listed) >= args.workers:
                break
            if time.time() > deadline or any(w.poll() is not None for w in workers):
                sys.exit(f"the workers did not all register: see {work}/log.txt")
            time.sleep(0.05)
    # Anything else running skews the time: say how busy the machine was.
    load_at_submit = os.getloadavg()[0]
    started = time.perf_counter()
    out = subprocess.run(cli + ["submit", spec], capture_output=True, text=True, check=True)
    job = out.stdout.split()[2].rstrip(":")
    if after_submit:
        # A fleet that scales up for the job: the workers start now.
        start_workers()
    while True:
        status = json.loads(subprocess.run(cli + ["status", job, "--json"], capture_output=True,
                                           text=True, check=True).stdout)
        if status["state"] in ("succeeded", "failed", "cancelled"):
            break
        # The job's time is the coordinator's (`wall_s`), so polling
        # slowly costs the measurement nothing and the workers no CPU.
        time.sleep(0.2)
    seconds = time.perf_counter() - started
    for c in cycles:
        c.stop()
    report = json.loads(subprocess.run(cli + ["report", job, "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    for w in workers:
        if fleet_up or args.control:
            w.terminate()
        w.wait(timeout=60)
    coordinator.terminate()
    coordinator.wait(timeout=30)
    if quota:
        quota.remove()
    for q in fast_quotas.values():
        q.remove()
    if args.keep_log:
        shutil.copy(os.path.join(work, "log.txt"), args.keep_log)
    if status["state"] != "succeeded":
        sys.exit(f"job {job} ended {status['state']}: see {work}/log.txt")
    causes = report["seconds"]
    if args.start == "after-submit":
        contender = f"late-{args.slow_by}-{'with' if args.slow else 'without'}-slow"
        if args.control:
            contender = f"late-{args.slow_by}-control"
    elif args.workers > 1:
        contender = f"stoke-split-{args.split}"
    else:
        contender = f"stoke-solo-{'slow' if args.slow else 'fast'}"
    result = {
        "contender": contender,
        "round": args.round,
        "workers": args.workers,
        "slow": args.slow,
        "slow_by": args.slow_by,
        "duty": args.duty,
        "cycle_ms": args.cycle_ms,
        "slow_from": args.slow_from,
        "backup": args.backup,
        "fast_duty": args.fast_duty,
        "fast_by": args.fast_by,
        # `budget`: a CPU budget per worker (fast ones in quotas of their
        # own); `shared`: the fast workers fill the machine's cores.
        "setup": "budget" if args.fast_by == "quota" and args.fast_duty < 1.0 else "shared",
        "start": args.start,
        "format": args.format,
        "seconds": round(report["wall_s"], 3),
        "load_1m": round(load_at_submit, 2),
        "polled_s": round(seconds, 3),
        "records": report["records"],
        "shards_split": report["shards_split"],
        "processor_s": round(report["processor_s"], 2),
        "causes_s": {k: round(v, 2) for k, v in causes.items()},
        "causes_sum_s": round(sum(causes.values()), 2),
        # Each worker's model seconds: what the slow one got through.
        "model_s": {d["worker"]: round(d["model_s"], 2) for d in report.get("devices", [])},
    }
    shutil.rmtree(work, ignore_errors=True)
    return result


class PidPredictor:
    """The W1 predictor, which also names its process for the slowdown."""

    def __init__(self, model_path, pid_dir):
        import torch

        torch.set_num_threads(1)
        self.torch = torch
        self.model = torch.jit.load(model_path)
        self.model.eval()
        with open(os.path.join(pid_dir, str(os.getpid())), "w") as f:
            f.write(str(time.time()))

    def __call__(self, batch):
        import numpy as np

        torch = self.torch
        features = batch["features"]
        if features.dtype == object:
            features = np.stack(features)
        x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        with torch.no_grad():
            prediction = self.model(x).argmax(dim=1).numpy().astype(np.int64)
        return {"id": batch["id"], "prediction": prediction}


def run_ray(args):
    import ray

    work = tempfile.mkdtemp(prefix="straggler-ray-", dir=args.work)
    pid_dir = os.path.join(work, "pids")
    os.makedirs(pid_dir)
    out_dir = os.path.join(work, "out")
    # One CPU per actor and one left for reading and writing.
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    cycles = []
    done = threading.Event()

    def slow_down():
        # Slow the first `--slow` actors as soon as they exist (and the
        # others to `--fast-duty`).
        seen = set()
        while not done.is_set() and len(seen) < args.workers:
            for name in sorted(os.listdir(pid_dir)):
                if name in seen:
                    continue
                seen.add(name)
                i = len(seen) - 1
                if i < args.slow:
                    cycles.append(DutyCycle(int(name), args.duty, phase[i]))
                elif args.fast_duty < 1.0:
                    cycles.append(DutyCycle(int(name), args.fast_duty, phase[i]))
            time.sleep(0.005)

    phase = phases(args.workers, args.slow, args.fast_duty)
    slower = threading.Thread(target=slow_down, daemon=True)
    slower.start()
    started = time.perf_counter()
    # Ray reads the 4 files as one input by default, so one actor can get
    # most of the data; blocks of about 2,000 records let its pool balance
    # (Ray's own advice, in the warning it prints without this).
    ds = ray.data.read_parquet(os.path.abspath(args.data_dir),
                               override_num_blocks=args.ray_blocks or None).select_columns(["id", "features"])
    ds = ds.map_batches(
        PidPredictor,
        fn_constructor_args=(os.path.abspath(args.model), pid_dir),
        compute=ray.data.ActorPoolStrategy(size=args.workers),
        num_cpus=1,
        batch_size=BATCH,
        batch_format="numpy",
    )
    ds.write_parquet(out_dir)
    seconds = time.perf_counter() - started
    done.set()
    for c in cycles:
        c.stop()
    records = sum(pq.ParquetFile(os.path.join(out_dir, f)).metadata.num_rows
                  for f in os.listdir(out_dir) if f.endswith(".parquet"))
    ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    return {"contender": "ray" if args.ray_blocks else "ray-default-blocks", "workers": args.workers, "slow": args.slow, "duty": args.duty,
            "seconds": round(seconds, 3), "records": records}


def make_model(path):
    """W1's MLP made heavier (256 -> 1536 -> 1536 -> 10, about 7x W1's
    multiply-adds per record), so the model, not start-up, fills the job."""
    import torch

    torch.manual_seed(20240611)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1536), torch.nn.ReLU(),
        torch.nn.Linear(1536, 1536), torch.nn.ReLU(),
        torch.nn.Linear(1536, 10),
    ).eval()
    tmp = path + ".tmp"
    torch.jit.script(model).save(tmp)
    os.replace(tmp, path)


def summarize(results_path):
    """A markdown table: each contender's median seconds, and the fleet's
    against the ideal, records / the sum of the workers' throughputs
    measured alone (solo runs, start-up included as in the fleet's)."""
    import statistics

    rows = [json.loads(line) for line in open(results_path) if line.startswith("{")]
    by = {}
    for r in rows:
        by.setdefault(r["contender"], []).append(r)
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in by.items()}
    records = rows[0]["records"]
    fast = records / med["stoke-solo-fast"]
    slow = records / med["stoke-solo-slow"]
    fleet = by.get("stoke-split-on", by.get("stoke-split-off"))[0]
    n_slow, n = fleet["slow"], fleet["workers"]
    ideal = records / ((n - n_slow) * fast + n_slow * slow)
    print(f"Ideal for {n} workers ({n_slow} running {fleet['duty']:.3g} of the time, the others "
          f"{fleet.get('fast_duty', 1.0):.3g}): {ideal:.2f} s "
          f"(alone: {fast:,.0f} records/s a fast worker, {slow:,.0f} the slow one)")
    print()
    print("| contender | runs | median s | vs ideal | shards split | tail_idle s | causes / processor s |")
    print("|---|---|---|---|---|---|---|")
    for name in ["stoke-split-off", "stoke-split-on", "ray", "ray-default-blocks", "stoke-solo-fast",
                 "stoke-solo-slow"]:
        if name not in by:
            continue
        rs = by[name]
        last = rs[-1]
        split = last.get("shards_split", "")
        tail = last.get("causes_s", {}).get("tail_idle", "")
        cover = (f"{last['causes_sum_s']:.1f} / {last['processor_s']:.1f}"
                 if "processor_s" in last else "")
        ratio = f"{med[name] / ideal:.2f}x" if not name.startswith("stoke-solo") else ""
        print(f"| {name} | {len(rs)} | {med[name]:.2f} | {ratio} | {split} | {tail} | {cover} |")


def ratios(results_path):
    """The late-start table: per set-up (`budget`: a CPU quota per fast
    worker; `shared`: the fast workers fill the cores) and slowdown,
    wall(2 + slow) / wall(2) of each round (the runs of a round ran one
    after the other), their median and worst; and the control's (a third
    worker that never gets work)."""
    import statistics

    rows = [json.loads(line) for line in open(results_path) if line.startswith("{")]
    by = {}
    for r in rows:
        if r.get("start") != "after-submit":
            continue
        kind = "control" if r["contender"].endswith("-control") else ("with" if r["slow"] else "without")
        by.setdefault((r.get("setup", "shared"), r["slow_by"]), {}).setdefault(r["round"], {})[kind] = r
    how = {"stop": "SIGSTOP/SIGCONT, {:.3g}% of each {:.3g} ms", "quota": "a cgroup CPU quota of {:.3g}% of a core"}
    setups = {"budget": "budget: each fast worker {:.3g}% of a core (a cgroup quota)",
              "shared": "shared: the fast workers fill the 2 cores"}
    print("| set-up | slow worker slowed by | rounds | wall(2) s, median | wall(2 + slow) s, median | "
          "wall(2 + slow) / wall(2), per round | median | worst | ideal | "
          "control / wall(2), per round | median | wall(2 + slow) / wall(2 + control), per round | worst | "
          "target: <= 1.05 in every round |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---|---:|---|---:|---|")
    for (setup, slow_by), rounds in sorted(by.items()):
        pairs = [r for _, r in sorted(rounds.items()) if "without" in r and "with" in r]
        if not pairs:
            continue
        ratio = [r["with"]["seconds"] / r["without"]["seconds"] for r in pairs]
        control = [r["control"]["seconds"] / r["without"]["seconds"] for r in pairs if "control" in r]
        # Issue 48's measure: the slow worker against the control (the
        # same third process, never given work), round by round.
        against = [r["with"]["seconds"] / r["control"]["seconds"] for r in pairs if "control" in r]
        duty = pairs[0]["with"]["duty"]
        fast_duty = pairs[0]["with"].get("fast_duty", 1.0) if setup == "budget" else 1.0
        # A worker at `duty / fast_duty` of a fast one's speed adds that
        # to two.
        ideal = f"{2 / (2 + duty / fast_duty):.2f}"
        met = "met" if against and max(against) <= 1.05 else "missed"
        cycle = pairs[0]["with"].get("cycle_ms", 40)
        listed = lambda xs: ", ".join(f"{x:.2f}" for x in xs) or "-"
        control_median = f"{statistics.median(control):.2f}" if control else "-"
        slowed = how.get(slow_by, slow_by).format(duty * 100, cycle)
        worst = f"{max(against):.2f}" if against else "-"
        print(f"| {setups.get(setup, setup).format(fast_duty * 100)} | {slowed} | "
              f"{len(pairs)} | "
              f"{statistics.median(r['without']['seconds'] for r in pairs):.2f} | "
              f"{statistics.median(r['with']['seconds'] for r in pairs):.2f} | "
              f"{listed(ratio)} | {statistics.median(ratio):.2f} | {max(ratio):.2f} | {ideal} | "
              f"{listed(control)} | {control_median} | {listed(against)} | {worst} | {met} |")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "model":
        make_model(sys.argv[2])
        return
    if len(sys.argv) == 3 and sys.argv[1] == "summary":
        summarize(sys.argv[2])
        return
    if len(sys.argv) == 3 and sys.argv[1] == "ratios":
        ratios(sys.argv[2])
        return
    if len(sys.argv) == 4 and sys.argv[1] == "jsonl":
        make_jsonl(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["stoke", "ray"])
    parser.add_argument("rest", nargs="+")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slow", type=int, default=1)
    parser.add_argument("--duty", type=float, default=0.25)
    parser.add_argument("--slow-from", choices=["start", "registered"], default="start",
                        help="SIGSTOP: slow the slow worker from its first instruction, or once the coordinator lists it")
    parser.add_argument("--cycle-ms", type=float, default=CYCLE_S * 1000,
                        help="the duty cycles' period (40 ms; issue 48's slow worker: 100, stopped 75 ms of each)")
    parser.add_argument("--fast-duty", type=float, default=1.0,
                        help="run the other workers this share of the time too (so the fleet fits the cores)")
    parser.add_argument("--split", choices=["on", "off"], default="on")
    parser.add_argument("--backup", choices=["on", "off"], default="on",
                        help="backup leases at the tail ([sharding] backup)")
    parser.add_argument("--ray-blocks", type=int, default=48,
                        help="ray: blocks the data is read into (0: Ray's default)")
    parser.add_argument("--start", choices=["fleet-up", "with-job", "after-submit"], default="fleet-up",
                        help="stoke: workers up and registered before the submit (a cluster's "
                             "fleet), started with the job, or just after the submit (process "
                             "start-up timed in both)")
    parser.add_argument("--fast-by", choices=["stop", "quota"], default="stop",
                        help="how the fast workers are held to --fast-duty (below 1): SIGSTOP duty cycles "
                             "taking turns, or a cgroup CPU quota of --fast-duty of a core each")
    parser.add_argument("--slow-by", choices=["stop", "quota"], default="stop",
                        help="stoke: slow the slow workers by SIGSTOP/SIGCONT duty cycles, or by a "
                             "cgroup CPU quota of --duty of a core")
    parser.add_argument("--format", choices=["parquet", "jsonl"], default="parquet",
                        help="stoke: the dataset's format (DATA_DIR holds it)")
    parser.add_argument("--round", type=int, default=0, help="recorded with the result")
    parser.add_argument("--control", action="store_true",
                        help="stoke: the slow workers start (and are slowed) as usual but never "
                             "reach the coordinator: what their processes alone cost the others")
    parser.add_argument("--keep-log", help="stoke: copy the run's log (coordinator and workers) here")
    args = parser.parse_args()
    set_cycle(args.cycle_ms)
    if args.kind == "stoke":
        args.bin_dir, args.data_dir, args.model, args.work = args.rest
        result = run_stoke(args)
    else:
        args.data_dir, args.model, args.work = args.rest
        result = run_ray(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
