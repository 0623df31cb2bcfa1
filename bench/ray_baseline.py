"""Contender (c): Ray Data. read_parquet -> map_batches with a callable class
(an actor pool of `--concurrency` actors) running the W1 TorchScript model on
CPU -> write_parquet, on a local Ray started here with 2 CPUs.

    python bench/ray_baseline.py DATA_DIR MODEL OUT_DIR --concurrency 1|2

Every actor gets 2 / concurrency torch intra-op threads and as many Ray CPUs
less a share left free for read and write tasks, so the box's 2 cores carry
2 torch threads in all, as for every other contender.

Prints `result records=N seconds=S init_seconds=I`: S is from just after
ray.init to the end of the write (startup excluded), I is ray.init itself.
The benchmark also times the whole command.
"""

import argparse
import os
import time

import numpy as np
import pyarrow.parquet as pq

BATCH = 1024
CPUS = 2


class Predictor:
    def __init__(self, model_path, threads):
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = torch.jit.load(model_path)
        self.model.eval()

    def __call__(self, batch):
        torch = self.torch
        features = batch["features"]
        if features.dtype == object:
            features = np.stack(features)
        x = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        with torch.no_grad():
            prediction = self.model(x).argmax(dim=1).numpy().astype(np.int64)
        return {"id": batch["id"], "prediction": prediction}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("data_dir")
    parser.add_argument("model")
    parser.add_argument("out_dir")
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args()

    import ray

    init_started = time.perf_counter()
    ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
    init_seconds = time.perf_counter() - init_started
    started = time.perf_counter()
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    threads = max(1, CPUS // args.concurrency)
    # Leave one CPU's worth for read and write tasks, or the actors take
    # every CPU and reading cannot be scheduled.
    actor_cpus = (CPUS - 1) / args.concurrency
    ds = ray.data.read_parquet(os.path.abspath(args.data_dir)).select_columns(["id", "features"])
    # An actor pool of `concurrency` actors (what `concurrency=N` means for a
    # callable class; Ray 2.51+ spells it `compute=ActorPoolStrategy`).
    ds = ds.map_batches(
        Predictor,
        fn_constructor_args=(os.path.abspath(args.model), threads),
        compute=ray.data.ActorPoolStrategy(size=args.concurrency),
        num_cpus=actor_cpus,
        batch_size=BATCH,
        batch_format="numpy",
    )
    ds.write_parquet(os.path.abspath(args.out_dir))
    seconds = time.perf_counter() - started
    records = sum(
        pq.ParquetFile(os.path.join(args.out_dir, f)).metadata.num_rows
        for f in os.listdir(args.out_dir)
        if f.endswith(".parquet")
    )
    ray.shutdown()
    print(f"result records={records} seconds={seconds:.4f} init_seconds={init_seconds:.4f}")


if __name__ == "__main__":
    main()
