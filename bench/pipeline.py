"""Issue 49's benchmark: a CPU pool feeding a GPU pool, against one pool,
at the same total CPU. An image workload where preprocessing dominates
(bench/pipeline_processor.py: decode, 12 blurs, resize; a small CNN).

Each worker runs in a cgroup of its own with a CPU quota (as
bench/straggler.py's `budget` set-up does), standing for separate
machines on this 2-core one:

- `one-pool`: 2 workers of 1.0 core each, each decoding for itself with
  `load_fn` (1 load process) and running the model;
- `two-pools`: 1 decode worker on the `cpu` pool (DECODE cores, 2 load
  processes) feeding, through a pipeline, 1 classify worker on the `gpu`
  pool (2 - DECODE cores) that runs the built-in TorchScript runner.

    python bench/pipeline.py data DIR COUNT            # PNGs and model.pt in DIR
    python bench/pipeline.py run BIN_DIR DIR WORK SETUP [--decode-share 1.5]
    python bench/pipeline.py ray DIR WORK [--decode-share 1.5]   # Ray Data (a venv with ray)
    python bench/pipeline.py table RESULTS.jsonl

`ray` is the same two-stage work on Ray Data, at the same 2 cores
(`ray.init(num_cpus=2)`): `map_batches` of the decode function as tasks
of `--decode-share / 2` CPU each (so two run at once), then an actor pool
of one actor (`2 - --decode-share` CPU) running the model, as Ray's docs
write a CPU preprocessing stage feeding a GPU model.

`run` prints one JSON line: records, seconds (submit to the last stage's
success), records/s, and the model's busy fraction (model seconds over
the processor seconds of the workers that run it: the classify stage's
report, or the one-pool job's).
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from straggler import CpuQuota, wait_file  # noqa: E402

BATCH = 16


def make_data(folder, count):
    sys.path.insert(0, str(HERE.parent / "examples" / "graphbook"))
    from make_images import write

    import pipeline_processor

    folder = pathlib.Path(folder)
    write(folder / "images", int(count), 96)
    pipeline_processor.export_model(folder / "model.pt")


def one_pool_spec(data):
    return f"""name = "one-pool"
[dataset]
format = "files"
uri = "{data}/images/"
[processor]
python = "pipeline_processor:DecodeClassify"
python_path = ["{HERE}"]
threads = 1
params = {{ model_path = "{data}/model.pt" }}
[loading]
workers = 1
[batching]
batch_size = {BATCH}
[sharding]
records = 200
"""


def two_pools_spec(data):
    return f"""name = "two-pools"

[[stage]]
name = "decode"
[stage.scheduling]
pool = "cpu"
[stage.dataset]
format = "files"
uri = "{data}/images/"
[stage.processor]
python = "pipeline_processor:Decode"
python_path = ["{HERE}"]
threads = 1
[stage.loading]
workers = 2
[stage.batching]
batch_size = {BATCH}
[stage.checkpoint]
interval = 2
[stage.sharding]
records = 200

[[stage]]
name = "classify"
[stage.scheduling]
pool = "gpu"
[stage.processor]
name = "torchscript"
threads = 1
[stage.processor.params]
model = "{data}/model.pt"
input_column = "pixels"
input_shape = [3, 64, 64]
outputs = ["argmax"]
[stage.batching]
batch_size = {BATCH}

[pipeline]
max_pending = 8
"""


def run(args):
    data = os.path.abspath(args.data)
    os.makedirs(args.work, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"pipeline-{args.setup}-", dir=args.work)
    logs = open(os.path.join(work, "log.txt"), "w")
    addr_file = os.path.join(work, "addr")
    coordinator = subprocess.Popen(
        [os.path.join(args.bin_dir, "stoke-coordinator"), "--listen", "127.0.0.1:0", "--http-listen", "off",
         "--root", os.path.join(work, "root"), "--addr-file", addr_file, "--pool", "cpu,gpu"],
        stdout=logs, stderr=subprocess.STDOUT)
    addr = "http://" + wait_file(addr_file, coordinator, "the coordinator")
    cli = [os.path.join(args.bin_dir, "stoke"), "--coordinator", addr]
    if args.setup == "one-pool":
        workers = [("default", 1.0, "w0"), ("default", 1.0, "w1")]
        spec = one_pool_spec(data)
    else:
        workers = [("cpu", args.decode_share, "decode"), ("gpu", 2.0 - args.decode_share, "classify")]
        spec = two_pools_spec(data)
    spec_path = os.path.join(work, "spec.toml")
    with open(spec_path, "w") as f:
        f.write(spec)
    quotas, procs = [], []
    try:
        # Workers up and registered first (a fleet already up), each in its
        # own cgroup from its first instruction.
        for pool, share, name in workers:
            quota = CpuQuota(share, f"stoke-pipeline-{os.getpid()}-{name}")
            quotas.append(quota)
            cmd = [os.path.join(args.bin_dir, "stoke-worker"), "--coordinator", addr, "--worker-id", name,
                   "--pool", pool, "--device", "cpu", "--threads", "1", "--exit-when-idle",
                   "--python-prewarm", "--python-prewarm-loading"]
            cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', quota.procs] + cmd
            procs.append(subprocess.Popen(cmd, stdout=logs, stderr=subprocess.STDOUT))
        started = time.perf_counter()
        out = subprocess.run(cli + ["submit", spec_path, "--job-id", "bench", "--wait", "--json"],
                             capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if out.returncode != 0:
            sys.exit(f"{args.setup}: {out.stderr}{out.stdout}")
        model_job = "bench" if args.setup == "one-pool" else "bench-classify"
        report = json.loads(subprocess.run(cli + ["report", model_job, "--json"], capture_output=True,
                                           text=True, check=True).stdout)
        status = json.loads(subprocess.run(cli + ["status", model_job, "--json"], capture_output=True,
                                           text=True, check=True).stdout)
        records = status["records_done"]
        # The model's own compute: the built-in runner's model time (its
        # forward pass); the one-pool processor's timed forward passes
        # (its process_batch time also holds the wait for its load
        # processes), from its outputs.
        if args.setup == "one-pool":
            import pyarrow.dataset as ds

            table = ds.dataset(os.path.join(work, "root", "jobs", "bench", "outputs"), format="parquet").to_table()
            model_s = float(sum(table.column("model_s").to_pylist()))
        else:
            model_s = report["seconds"]["model"]
        print(json.dumps({
            "setup": args.setup, "records": records, "seconds": round(seconds, 3),
            "records_per_s": round(records / seconds, 1),
            "model_busy": round(model_s / report["processor_s"], 3) if report["processor_s"] else 0.0,
            "model_s": round(model_s, 2),
            "processor_s": round(report["processor_s"], 2),
            "input_wait_s": round(report["seconds"]["input_wait"], 2),
            "decode_share": args.decode_share if args.setup == "two-pools" else None,
        }), flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        coordinator.terminate()
        coordinator.wait(timeout=30)
        for q in quotas:
            q.remove()


def run_ray(args):
    import numpy as np
    import ray
    import torch

    import pipeline_processor

    data = os.path.abspath(args.data)
    os.makedirs(args.work, exist_ok=True)
    out = tempfile.mkdtemp(prefix="pipeline-ray-", dir=args.work)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    model_path = os.path.join(data, "model.pt")
    side = pipeline_processor.SIDE

    def decode(batch):
        torch.set_num_threads(1)
        pixels = torch.stack([pipeline_processor.preprocess(bytes(b)) for b in batch["bytes"]])
        return {"path": batch["path"], "pixels": pixels.flatten(1).numpy()}

    class Classify:
        def __init__(self):
            torch.set_num_threads(1)
            self.model = torch.jit.load(model_path)
            self.model_s = 0.0

        def __call__(self, batch):
            x = torch.from_numpy(np.ascontiguousarray(batch["pixels"], dtype=np.float32)).reshape(-1, 3, side, side)
            started = time.perf_counter()
            with torch.no_grad():
                pred = self.model(x).argmax(1).numpy()
            each = (time.perf_counter() - started) / len(pred)
            return {"path": batch["path"], "prediction": pred, "model_s": np.full(len(pred), each)}

    started = time.perf_counter()
    ds = ray.data.read_binary_files(os.path.join(data, "images"), include_paths=True)
    ds = ds.map_batches(decode, batch_size=BATCH, num_cpus=args.decode_share / 2, batch_format="numpy")
    ds = ds.map_batches(Classify, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=2.0 - args.decode_share,
                        batch_size=BATCH, batch_format="numpy")
    ds.write_parquet(out)
    seconds = time.perf_counter() - started
    ray.shutdown()
    import pyarrow.dataset as pads

    table = pads.dataset(out, format="parquet").to_table()
    records = table.num_rows
    model_s = float(sum(table.column("model_s").to_pylist()))
    print(json.dumps({
        "setup": "ray", "records": records, "seconds": round(seconds, 3),
        "records_per_s": round(records / seconds, 1),
        # The actor's processor time is its share of the wall time.
        "model_busy": round(model_s / seconds, 3),
        "model_s": round(model_s, 2),
        "decode_share": args.decode_share,
    }), flush=True)


def table(path):
    import statistics

    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    by = {}
    for r in rows:
        by.setdefault(r["setup"], []).append(r)
    print("| set-up | rounds | records/s, per round | median | model busy, per round | median |")
    print("|---|---:|---|---:|---|---:|")
    for setup in ("one-pool", "two-pools", "ray"):
        rs = by.get(setup, [])
        if not rs:
            continue
        rate = [r["records_per_s"] for r in rs]
        busy = [r["model_busy"] for r in rs]
        print(f"| {setup} | {len(rs)} | {', '.join(f'{x:.0f}' for x in rate)} | {statistics.median(rate):.0f} "
              f"| {', '.join(f'{x:.2f}' for x in busy)} | {statistics.median(busy):.2f} |")
    if by.get("one-pool") and by.get("two-pools"):
        one = statistics.median(r["records_per_s"] for r in by["one-pool"])
        two = statistics.median(r["records_per_s"] for r in by["two-pools"])
        b1 = statistics.median(r["model_busy"] for r in by["one-pool"])
        b2 = statistics.median(r["model_busy"] for r in by["two-pools"])
        print(f"\ntwo pools / one pool: records/s {two / one:.2f}x, model busy {b2 / b1 if b1 else float('inf'):.2f}x "
              f"({b1:.2f} -> {b2:.2f})")
    if by.get("ray") and by.get("two-pools"):
        ray_rate = statistics.median(r["records_per_s"] for r in by["ray"])
        two = statistics.median(r["records_per_s"] for r in by["two-pools"])
        per_round = [t["records_per_s"] / r["records_per_s"] for t, r in zip(by["two-pools"], by["ray"])]
        print(f"two pools / Ray Data: records/s {two / ray_rate:.2f}x (per round: "
              f"{', '.join(f'{x:.2f}' for x in per_round)})")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    d = sub.add_parser("data")
    d.add_argument("dir")
    d.add_argument("count", type=int)
    r = sub.add_parser("run")
    r.add_argument("bin_dir")
    r.add_argument("data")
    r.add_argument("work")
    r.add_argument("setup", choices=["one-pool", "two-pools"])
    r.add_argument("--decode-share", type=float, default=1.5)
    y = sub.add_parser("ray")
    y.add_argument("data")
    y.add_argument("work")
    y.add_argument("--decode-share", type=float, default=1.5)
    t = sub.add_parser("table")
    t.add_argument("results")
    args = p.parse_args()
    if args.what == "data":
        make_data(args.dir, args.count)
    elif args.what == "run":
        run(args)
    elif args.what == "ray":
        run_ray(args)
    else:
        table(args.results)


if __name__ == "__main__":
    main()
