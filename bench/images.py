"""Image workload (issue 32): PNG files, 96x96, decoded and transformed
per record (PIL decode -> resize to 160x160 -> to_tensor -> Normalize),
then a small CNN; predictions
written out. One contender per call, printing
``result contender=NAME records=N seconds=S steady=R``: ``seconds`` is
timed inside the process (imports excluded), ``steady`` is the records/s
of the steady state, between the first output part written (after 10
batches) and the last, so that start-up (importing torch, starting
processes) is left out alike for every contender that writes parts.
``bench/images.sh`` adds the whole command's wall time.

    python bench/images.py data DIR COUNT
    python bench/images.py loop DIR OUT            # (a) DataLoader(num_workers=2) -> model -> torch.save
    python bench/images.py stoke-dataset DIR ROOT  # (b) torch_batch_process(..., dataset, num_workers=2), in process
    python bench/images.py stoke-load-fn DIR ROOT WORKERS [stack]  # (c) `stoke run --local 1`, load_fn on WORKERS
                                                   # load processes; `stack`: Graphbook's torch.stack(batch.samples)
    python bench/images.py load-bound DIR ROOT WORKERS BATCH   # issue 48: (c) with a loading-bound load_fn
                                                   # (12 Gaussian blurs and a resize), batches of BATCH, shards of 500
    python bench/images.py ray DIR OUT             # (d) Ray Data read_images + map_batches (bench venv)

Every contender runs the model with one intra-op thread and loads with
two processes, so all use the machine's two cores alike. With
``STOKE_BENCH_DEVICE=cuda:0`` (a), (b) and (c) put the model on the GPU and
(a), (b) pin memory.
"""

import io
import json
import os
import pathlib
import subprocess
import sys
import time

BATCH = 64
DEVICE = os.environ.get("STOKE_BENCH_DEVICE", "cpu")
# The DataLoader's worker processes in (a) and (b) (bench/gpu/images.sh
# tries more on a GPU machine's 16 cores); (c) takes its own from the
# command line.
LOADERS = int(os.environ.get("STOKE_BENCH_LOADERS", "2"))
HERE = pathlib.Path(__file__).resolve().parent


def get_model():
    """A small CNN: the model is not the bottleneck here (about 3,000
    images/s on one core), loading is."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 5, stride=4, padding=2), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 10),
    )


SIZE = 160
# STOKE_BENCH_HEAVY=1: a CPU-heavy load (see transform_bytes).
HEAVY = os.environ.get("STOKE_BENCH_HEAVY") == "1"
# Issue 48's loading-bound step (Graphbook's load_fn case): Gaussian
# blurs per record before the resize (see blurred_bytes).
BLURS = 12
# Its shards: 500 records each.
LOAD_BOUND_SHARD = 500


def transform_bytes(data):
    """Decode and transform one image (what every contender does per
    record): PNG decode, resize to 160x160 (bilinear, antialiased),
    to_tensor, normalize."""
    import torchvision.transforms.functional as F
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB").resize((SIZE, SIZE), Image.BILINEAR)
    tensor = F.normalize(F.to_tensor(image), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    if HEAVY:
        # A CPU-heavy per-record step on top (augmentation-like): the
        # load_fn's own cost dominates the per-record overhead around it.
        tensor = F.gaussian_blur(tensor, kernel_size=[9, 9])
    return tensor


def blurred_bytes(data):
    """Issue 48's loading-bound ``load_fn``: decode, 12 Gaussian blurs
    (9x9, on the 96x96 tensor), resize to 160x160. About 4 ms per image
    on one core here, so the small CNN (well under 1 ms per image) never
    holds the load processes back: records/s is load_fn's."""
    import torchvision.transforms.functional as F
    from PIL import Image

    tensor = F.to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))
    for _ in range(BLURS):
        tensor = F.gaussian_blur(tensor, kernel_size=[9, 9])
    return F.resize(tensor, [SIZE, SIZE], antialias=True)


class PngFolder:
    """A map-style Dataset over a folder of PNG files: (image, index)."""

    def __init__(self, folder):
        self.paths = sorted(str(p) for p in pathlib.Path(folder).glob("*.png"))

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return transform_bytes(f.read()), i


def steady(parts, records, first=10 * BATCH):
    """Records/s between the first output part written and the last: the
    first part holds the first ``first`` records (10 batches), written once
    the pipeline runs."""
    times = sorted(os.path.getmtime(p) for p in parts)
    if len(times) < 3:
        return None
    return (records - first) / (times[-1] - times[0])


def steady_parquet(parts, records):
    """``steady`` over Parquet parts of any size: the records of the first
    part written are read from its footer."""
    import pyarrow.parquet as pq

    parts = sorted(parts, key=os.path.getmtime)
    if len(parts) < 3:
        return None
    return steady(parts, records, pq.ParquetFile(parts[0]).metadata.num_rows)


def make_data(folder, count):
    sys.path.insert(0, str(HERE.parent / "examples" / "graphbook"))
    from make_images import write

    write(folder, int(count), 96)


def loop(folder, out):
    import torch

    torch.set_num_threads(1)
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    model = get_model().eval().to(DEVICE)
    loader = torch.utils.data.DataLoader(PngFolder(folder), batch_size=BATCH, num_workers=LOADERS,
                                         pin_memory=DEVICE != "cpu")
    records, buffered, part = 0, [], 0
    with torch.no_grad():
        for images, indices in loader:
            pred = model(images.to(DEVICE, non_blocking=True)).argmax(1).cpu()
            buffered.append({"indices": indices, "predictions": pred})
            records += len(indices)
            if len(buffered) == 10:
                torch.save(buffered, os.path.join(out, f"part-{part:05d}.pt"))
                buffered, part = [], part + 1
    if buffered:
        torch.save(buffered, os.path.join(out, f"part-{part:05d}.pt"))
    seconds = time.perf_counter() - started
    return records, seconds, steady(pathlib.Path(out).glob("part-*.pt"), records)


def stoke_dataset(folder, root):
    import torch

    import stoke

    class Predict(stoke.TorchBatchProcessor):
        def __init__(self, context):
            self.context = context
            self.model = context.prepare_model_for_inference(get_model())

        def process_batch(self, batch, batch_idx):
            with torch.no_grad():
                pred = self.model(self.context.to_device(batch[0])).argmax(1)
            self.context.write_rows({"id": batch.ids, "prediction": pred})

    torch.set_num_threads(1)
    started = time.perf_counter()
    report = stoke.torch_batch_process(
        Predict, PngFolder(folder), batch_size=BATCH, checkpoint_interval=10,
        dataloader_kwargs={"num_workers": LOADERS, "pin_memory": DEVICE != "cpu"},
        root=root, device=DEVICE, threads=1)
    seconds = time.perf_counter() - started
    parts = pathlib.Path(root).glob("jobs/*/outputs/**/*.parquet")
    return report["records"], seconds, steady(parts, report["records"])


def stoke_load_fn(folder, root, workers, stack=None):
    # batch.collated (the load process's batch), or Graphbook's step as
    # written (torch.stack(batch.samples): one more copy of each batch).
    processor = "PredictStack" if stack == "stack" else "Predict"
    spec = {
        "dataset": {"format": "files", "uri": os.path.abspath(folder)},
        "processor": {"python": f"images_processor:{processor}", "python_path": [str(HERE)], "threads": 1},
        "loading": {"workers": int(workers)},
        "batching": {"batch_size": BATCH},
        "checkpoint": {"interval": 10},
    }
    return run_local(spec, root)


def load_bound(folder, root, workers, batch):
    """Issue 48's case: Graphbook's step with a loading-bound ``load_fn``
    (``images_processor:Blurred``), batches of ``batch``, shards of 500
    records, checkpoints at the default interval, ``run --local 1``."""
    spec = {
        "dataset": {"format": "files", "uri": os.path.abspath(folder)},
        "processor": {"python": "images_processor:Blurred", "python_path": [str(HERE)], "threads": 1},
        "loading": {"workers": int(workers)},
        "batching": {"batch_size": int(batch)},
        "sharding": {"records": LOAD_BOUND_SHARD},
    }
    records, seconds, _ = run_local(spec, root)
    rate = steady_parquet(pathlib.Path(root).glob("jobs/*/outputs/**/*.parquet"), records)
    return records, seconds, rate


def run_local(spec, root):
    """Runs ``spec`` with ``stoke run --local 1``: records, seconds and
    the steady rate (parts of 10 batches)."""
    path = pathlib.Path(root).with_suffix(".json")
    path.write_text(json.dumps(spec))
    started = time.perf_counter()
    out = subprocess.run(["stoke", "run", "--local", "1", str(path), "--root", root, "--device", DEVICE,
                          "--threads", "1"], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    manifest = next(pathlib.Path(root).glob("jobs/*/manifest.json"))
    records = json.loads(manifest.read_text())["records_in"]
    return records, seconds, steady(pathlib.Path(root).glob("jobs/*/outputs/**/*.parquet"), records)


def ray_data(folder, out):
    import numpy as np
    import ray
    import torch

    class Predict:
        def __init__(self):
            torch.set_num_threads(1)
            self.model = get_model().eval()

        def __call__(self, batch):
            images = torch.from_numpy(np.ascontiguousarray(batch["image"], dtype=np.float32)) / 255.0
            images = (images.permute(0, 3, 1, 2) - 0.5) / 0.5
            with torch.no_grad():
                pred = self.model(images).argmax(1).numpy()
            return {"path": batch["path"], "prediction": pred}

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter()
    ray.data.DataContext.get_current().enable_progress_bars = False
    # read_images decodes and resizes (PIL, bilinear) in its read tasks.
    ds = ray.data.read_images(os.path.abspath(folder), mode="RGB", include_paths=True, size=(SIZE, SIZE))
    ds = ds.map_batches(Predict, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1, batch_size=BATCH,
                        batch_format="numpy")
    ds.write_parquet(os.path.abspath(out))
    seconds = time.perf_counter() - started
    import pyarrow.parquet as pq

    records = sum(pq.ParquetFile(p).metadata.num_rows for p in pathlib.Path(out).glob("*.parquet"))
    ray.shutdown()
    # Ray writes its Parquet files as its blocks finish, not by batch
    # count: no steady state to compare.
    return records, seconds, None


def main():
    what, args = sys.argv[1], sys.argv[2:]
    if what == "data":
        make_data(*args)
        return
    run = {"loop": loop, "stoke-dataset": stoke_dataset, "stoke-load-fn": stoke_load_fn, "load-bound": load_bound,
           "ray": ray_data}[what]
    records, seconds, rate = run(*args)
    name = what
    if what == "stoke-load-fn":
        name = f"stoke-load-fn-{args[2]}" + "".join(f"-{a}" for a in args[3:])
    elif what == "load-bound":
        name = f"load-bound-b{args[3]}-w{args[2]}"
    # The same contender on another build (bench/images.sh's stoke-dataset-dev).
    name = os.environ.get("BENCH_NAME", name)
    if what == "stoke-dataset":
        import stoke

        print(f"stoke package: {os.path.dirname(stoke.__file__)}", file=sys.stderr)
    print(f"result contender={name} records={records} seconds={seconds:.3f} steady={rate or 0:.1f}")


if __name__ == "__main__":
    main()
