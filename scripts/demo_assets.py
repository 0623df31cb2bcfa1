#!/usr/bin/env python3
"""Build the stoke demo's inputs: digits Parquet data, the model as a .pt2 package (and as
TorchScript), a job spec.

Usage: demo_assets.py OUT_DIR

Writes, under OUT_DIR:
  digits/part-0.parquet .. part-3.parquet  sklearn's 1,797 handwritten digits, in order,
                                           row groups of 128 rows; columns
                                           id (string), pixels (fixed_size_list<float32,64>,
                                           values in [0,1]), label (int64)
  model.pt2                                the MLP 64 -> 128 -> 10 exported with torch.export (dynamic
                                           batch up to 1024) and compiled by AOTInductor: float32
                                           [B,64] -> logits [B,10]; what the job runs
  model.pt                                 the same model as TorchScript (the `torchscript` alias
                                           runs it the same way)
  test_ids.txt                             the held-out ids (not used for training), one per line
  digits.toml                              the job spec, with absolute file:// URIs

Idempotent: a marker file (.stoke-demo-assets) is written last; when it is present and
matches this script's version and OUT_DIR's absolute path, and every output exists,
nothing is redone. Training is seeded and runs on the CPU, so it is reproducible.
"""

import json
import os
import sys
import time
from pathlib import Path

ASSETS_VERSION = "stoke-demo-assets v2"
MARKER = ".stoke-demo-assets"
NUM_FILES = 4
ROW_GROUP_SIZE = 128
NUM_TRAIN = 1200
SEED = 20240601
STEPS = 600
BATCH = 128
LR = 3e-3


def usage() -> None:
    print("usage: demo_assets.py OUT_DIR", file=sys.stderr)
    sys.exit(2)


def outputs(out: Path) -> list:
    files = [out / "digits" / f"part-{i}.parquet" for i in range(NUM_FILES)]
    return files + [out / "model.pt", out / "model.pt2", out / "test_ids.txt", out / "digits.toml"]


def marker_text(out: Path) -> str:
    return f"{ASSETS_VERSION}\n{out}\n"


def complete(out: Path) -> bool:
    marker = out / MARKER
    try:
        if marker.read_text() != marker_text(out):
            return False
    except OSError:
        return False
    return all(p.is_file() and p.stat().st_size > 0 for p in outputs(out))


def replace_atomically(path: Path, write) -> None:
    """Write via a temporary sibling, then rename into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_parquet(out: Path, images, labels) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    digits_dir = out / "digits"
    digits_dir.mkdir(parents=True, exist_ok=True)
    # Leave no stray Parquet files from other runs: the job reads the whole folder.
    expected = {f"part-{i}.parquet" for i in range(NUM_FILES)}
    for stray in digits_dir.glob("*.parquet"):
        if stray.name not in expected:
            stray.unlink()

    n = len(labels)
    pixels = (images.reshape(n, 64).astype(np.float32) / np.float32(16.0)).astype(np.float32)
    ids = np.array([f"digit-{i:05d}" for i in range(n)], dtype=object)
    schema = pa.schema(
        [
            pa.field("id", pa.string()),
            pa.field("pixels", pa.list_(pa.float32(), 64)),
            pa.field("label", pa.int64()),
        ]
    )
    for i, rows in enumerate(np.array_split(np.arange(n), NUM_FILES)):
        flat = pa.array(pixels[rows].reshape(-1), type=pa.float32())
        table = pa.Table.from_arrays(
            [
                pa.array(ids[rows].tolist(), type=pa.string()),
                pa.FixedSizeListArray.from_arrays(flat, 64),
                pa.array(labels[rows].astype(np.int64), type=pa.int64()),
            ],
            schema=schema,
        )
        replace_atomically(
            digits_dir / f"part-{i}.parquet",
            lambda tmp, t=table: pq.write_table(t, tmp, row_group_size=ROW_GROUP_SIZE),
        )


def train(images, labels):
    """Train the MLP on a seeded split; return (scripted model, test indices, test accuracy)."""
    import numpy as np
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    n = len(labels)
    gen = torch.Generator().manual_seed(SEED)
    perm = torch.randperm(n, generator=gen)
    train_idx, test_idx = perm[:NUM_TRAIN], perm[NUM_TRAIN:]

    x = torch.from_numpy(images.reshape(n, 64).astype(np.float32) / np.float32(16.0))
    y = torch.from_numpy(labels.astype(np.int64))

    class DigitsMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(64, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)))

    model = DigitsMLP()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    x_train, y_train = x[train_idx], y[train_idx]
    model.train()
    for _ in range(STEPS):
        batch = torch.randint(0, len(train_idx), (BATCH,), generator=gen)
        opt.zero_grad()
        loss = loss_fn(model(x_train[batch]), y_train[batch])
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(x[test_idx]).argmax(dim=1)
        acc = (pred == y[test_idx]).float().mean().item()
    return model, sorted(test_idx.tolist()), acc


def export_pt2(model, path: Path) -> None:
    """torch.export with a dynamic batch, then AOTInductor (about a minute on a small CPU)."""
    import warnings

    import torch
    from torch.export import Dim

    with warnings.catch_warnings():
        # torch 2.11's own export and compile code still uses a pytree class
        # it deprecated (LeafSpec) and warns about it: nothing the demo can
        # change, and not a line for a newcomer's first screen.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
        program = torch.export.export(
            model, (torch.randn(64, 64),), dynamic_shapes=({0: Dim("batch", min=1, max=1024)},)
        )
        torch._inductor.aoti_compile_and_package(
            program,
            package_path=str(path),
            # The worker refuses a package compiled by another torch than its libtorch.
            inductor_configs={"aot_inductor.metadata": {"torch_version": torch.__version__}},
        )


def write_spec(out: Path) -> None:
    # Path.as_uri() percent-encodes characters that need it; json.dumps gives a valid
    # TOML basic string (quotes and backslashes escaped).
    digits_uri = (out / "digits").as_uri() + "/"
    model_uri = (out / "model.pt2").as_uri()
    spec = f"""name = "digits"

[dataset]
format = "parquet"
uri = {json.dumps(digits_uri)}
id_column = "id"

[processor]
name = "pytorch"

[processor.params]
model = {json.dumps(model_uri)}
input_column = "pixels"
outputs = ["argmax", "scores"]

[batching]
batch_size = 64

[checkpoint]
interval = 4

[sharding]
records = 256
"""
    replace_atomically(out / "digits.toml", lambda tmp: tmp.write_text(spec))


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        usage()
    out = Path(sys.argv[1]).expanduser().resolve()
    if complete(out):
        print(f"demo assets: up to date in {out}")
        return

    start = time.monotonic()
    import torch
    from sklearn.datasets import load_digits

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out.mkdir(parents=True, exist_ok=True)
    marker = out / MARKER
    if marker.exists():
        marker.unlink()

    digits = load_digits()
    images, labels = digits.images, digits.target
    write_parquet(out, images, labels)

    model, test_idx, acc = train(images, labels)
    scripted = torch.jit.script(model)
    replace_atomically(out / "model.pt", lambda tmp: scripted.save(str(tmp)))
    # aoti_compile_and_package checks the path's suffix: the temporary name ends in .pt2.
    tmp_pt2 = out / f".model-{os.getpid()}.pt2"
    try:
        export_pt2(model, tmp_pt2)
        os.replace(tmp_pt2, out / "model.pt2")
    finally:
        if tmp_pt2.exists():
            tmp_pt2.unlink()
    test_ids = "".join(f"digit-{i:05d}\n" for i in test_idx)
    replace_atomically(out / "test_ids.txt", lambda tmp: tmp.write_text(test_ids))
    write_spec(out)

    marker.write_text(marker_text(out))
    print(
        f"demo assets: {len(labels)} digits in {NUM_FILES} Parquet files, model trained on "
        f"{NUM_TRAIN}, held-out accuracy {acc:.3f} on {len(test_idx)} images "
        f"({time.monotonic() - start:.1f}s) -> {out}"
    )


if __name__ == "__main__":
    main()
