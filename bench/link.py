"""A slow link between worker and coordinator (issue 58, part 4): W1's data
on one worker whose gRPC connection goes through a proxy that holds every
chunk `--delay-ms` in each direction (so a round trip costs twice that),
against the same with 0 ms, side by side in one run. `--model` swaps W1's
model for a slower one (`bench/straggler.py model`): W1's own model does a
shard in a fifth of a second, shorter than one 400 ms round trip, so on it
the link's fixed costs (hearing of the job, the first lease, the last
commit) are the whole story.

    python bench/link.py run BIN_DIR W1_DIR WORK --delay-ms 200 --interval 100 --round 1 [--model M --label slow]
    python bench/link.py summary RESULTS.jsonl

`run` starts a coordinator, the proxy (in this process, asyncio, one thread)
and one worker (1 thread, `--device cpu`) that dials the proxy; waits until
the worker registered, submits W1 (`--interval` batches a checkpoint; 100 is
the default, and W1's shards are 25 batches, so a commit a shard) and
prints one JSON line: the delay, the interval, the job's `wall_s` and its
checkpoint seconds from `stoke report --json`. Nothing here asserts a time;
`summary` prints each delay's median against 0 ms at the same interval.
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from straggler import wait_file


class DelayProxy:
    """Forwards 127.0.0.1:<port> to `upstream`, every chunk `delay` seconds
    late in each direction, in order (bandwidth untouched: chunks read
    while earlier ones wait are not held up behind them)."""

    def __init__(self, upstream_port, delay):
        self.upstream_port = upstream_port
        self.delay = delay
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = None
        threading.Thread(target=self.run, daemon=True).start()
        self.ready.wait(10)

    def run(self):
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self.serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def serve(self, reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self.pump(reader, up_writer), self.pump(up_reader, writer),
                             return_exceptions=True)

    async def pump(self, reader, writer):
        queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                wait = due - self.loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                queue.put_nowait((self.loop.time() + self.delay, data))
        finally:
            queue.put_nowait((0, None))
            await sender


def spec_text(w1_dir, interval, model):
    return f"""name = "link"
[dataset]
format = "parquet"
uri = "file://{w1_dir}/data/"
id_column = "id"
[processor]
name = "torchscript"
[processor.params]
model = "file://{model}"
input_column = "features"
outputs = ["argmax"]
[batching]
batch_size = 1024
[checkpoint]
interval = {interval}
[sharding]
records = 25000
[output]
format = "parquet"
"""


def run(args):
    work = tempfile.mkdtemp(prefix="link-", dir=args.work)
    logs = open(os.path.join(work, "log.txt"), "w")
    addr_file = os.path.join(work, "addr")
    coordinator = subprocess.Popen(
        [os.path.join(args.bin_dir, "stoke-coordinator"), "--listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--root", os.path.join(work, "root"),
         "--addr-file", addr_file],
        stdout=logs, stderr=subprocess.STDOUT)
    addr = wait_file(addr_file, coordinator, "the coordinator")
    port = int(addr.rsplit(":", 1)[1])
    proxy = DelayProxy(port, args.delay_ms / 1000)
    cli = [os.path.join(args.bin_dir, "stoke"), "--coordinator", "http://" + addr]
    worker = subprocess.Popen(
        [os.path.join(args.bin_dir, "stoke-worker"), "--coordinator", f"http://127.0.0.1:{proxy.port}",
         "--worker-id", "w0", "--device", "cpu", "--threads", "1"],
        stdout=logs, stderr=subprocess.STDOUT, env=dict(os.environ, RUST_LOG="warn"))
    deadline = time.time() + 60
    while True:
        listed = json.loads(subprocess.run(cli + ["workers", "--json"], capture_output=True,
                                           text=True, check=True).stdout)
        if listed:
            break
        if time.time() > deadline or worker.poll() is not None:
            sys.exit(f"the worker did not register: see {work}/log.txt")
        time.sleep(0.05)
    spec = os.path.join(work, "job.toml")
    with open(spec, "w") as f:
        model = os.path.abspath(args.model or os.path.join(args.w1_dir, "model.pt"))
        f.write(spec_text(os.path.abspath(args.w1_dir), args.interval, model))
    load = os.getloadavg()[0]
    out = subprocess.run(cli + ["submit", spec], capture_output=True, text=True, check=True)
    job = out.stdout.split()[2].rstrip(":")
    while True:
        status = json.loads(subprocess.run(cli + ["status", job, "--json"], capture_output=True,
                                           text=True, check=True).stdout)
        if status["state"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.2)
    report = json.loads(subprocess.run(cli + ["report", job, "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    worker.terminate()
    worker.wait(timeout=60)
    coordinator.terminate()
    coordinator.wait(timeout=30)
    if status["state"] != "succeeded":
        sys.exit(f"job {job} ended {status['state']}: see {work}/log.txt")
    result = {
        "model": args.label,
        "delay_ms": args.delay_ms,
        "interval": args.interval,
        "round": args.round,
        "seconds": round(report["wall_s"], 3),
        "checkpoint_s": round(report["seconds"].get("checkpoint", 0.0), 3),
        "records": report["records"],
        "load_1m": round(load, 2),
    }
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result), flush=True)


def summary(args):
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    by = {}
    for r in rows:
        by.setdefault((r.get("model", "w1"), r["interval"], r["delay_ms"]), []).append(r)
    print("| model | checkpoint interval | delay each way | runs | job s (median) | checkpoint s (median) | vs 0 ms (median of per-round ratios) |")
    print("|---|---|---|---|---|---|---|")
    for (model, interval, delay) in sorted(by):
        rs = by[(model, interval, delay)]
        med = statistics.median(r["seconds"] for r in rs)
        cp = statistics.median(r["checkpoint_s"] for r in rs)
        base = {r["round"]: r["seconds"] for r in by.get((model, interval, 0), [])}
        ratios = [r["seconds"] / base[r["round"]] for r in rs if r["round"] in base]
        ratio = f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
        print(f"| {model} | {interval} batches | {delay} ms | {len(rs)} | {med:.2f} | {cp:.2f} | {ratio} |")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("bin_dir")
    r.add_argument("w1_dir")
    r.add_argument("work")
    r.add_argument("--delay-ms", type=int, default=0)
    r.add_argument("--interval", type=int, default=100)
    r.add_argument("--round", type=int, default=1)
    r.add_argument("--model", help="a TorchScript model over W1's features (default: W1's)")
    r.add_argument("--label", default="w1", help="the model's name in the results")
    s = sub.add_parser("summary")
    s.add_argument("results")
    args = p.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        summary(args)


if __name__ == "__main__":
    main()
