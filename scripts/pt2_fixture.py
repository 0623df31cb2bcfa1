#!/usr/bin/env python3
"""Models and data for stoke's `.pt2` (AOTInductor) tests.

Usage: pt2_fixture.py OUT_DIR

Compiling a package takes about a minute per model on a small machine, so
the test harness keeps OUT_DIR in ~/.cache/stoke/, keyed by this script's
content: a changed script builds a fresh folder, an unchanged one is reused.

Writes into OUT_DIR (a marker file, written last, records a complete build):
  digits/part-N.parquet  sklearn's 1,797 digits in 3 files (row groups of 100):
                         id (string "d-00000"), pixels (fixed_size_list<float32, 64>),
                         mirror (the same pixels, each row reversed)
  mlp.pt, mlp.pt2        a seeded MLP 64 -> 32 -> 10, as TorchScript and as a
                         package exported with a dynamic batch (Dim max 256)
  cnn.pt2                a seeded CNN on [B, 1, 8, 8] -> 10, dynamic batch (max 256)
  two.pt2                a model of two inputs (pixels, mirror) -> [B, 10]
  multi.pt2              an MLP returning a dict {"logits": [B, 10], "embedding": [B, 32]}
  mlp_cuda.pt2           mlp.pt2 with its device metadata rewritten to "cuda"
                         (this machine has no GPU, so no real CUDA package can be
                         compiled here; the worker refuses a package by that
                         metadata before it loads any code, which is what the
                         test checks)
  corrupt.pt2            the first half of mlp.pt2's bytes
  out3d.pt               TorchScript 64 -> [B, 2, 8] (an output argmax must refuse)
  reference.json         {model: {id: {"argmax": int, "scores": [10 floats]}}} for
                         mlp.pt2, cnn.pt2, two.pt2 and multi.pt2 (its logits) run by
                         torch._inductor.aoti_load_package, and mlp.pt run by TorchScript;
                         "multi.pt2:embedding" holds multi.pt2's embeddings as "scores"
"""

import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

VERSION = "4"
MAX_BATCH = 256
FILES = 3


def export_package(model, example, path: Path) -> None:
    """torch.export with a dynamic batch, then AOTInductor, as the README shows.
    `example`: one input, or a tuple of inputs that share the batch."""
    import torch
    from torch.export import Dim

    batch = Dim("batch", min=1, max=MAX_BATCH)
    inputs = example if isinstance(example, tuple) else (example,)
    program = torch.export.export(
        model, inputs, dynamic_shapes=tuple({0: batch} for _ in inputs)
    )
    torch._inductor.aoti_compile_and_package(
        program,
        package_path=str(path),
        inductor_configs={"aot_inductor.metadata": {"torch_version": torch.__version__}},
    )


def rewrite_device(src: Path, dst: Path, device: str) -> None:
    """A copy of a package whose metadata says it was compiled for `device`."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename.endswith("_metadata.json"):
                meta = json.loads(data)
                meta["AOTI_DEVICE_KEY"] = device
                data = json.dumps(meta).encode()
            zout.writestr(item, data)


def main() -> None:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1]).resolve()
    marker = out / ".stoke-pt2-fixture"
    if marker.exists() and marker.read_text() == VERSION:
        return
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from sklearn.datasets import load_digits

    out.mkdir(parents=True, exist_ok=True)
    (out / "digits").mkdir(exist_ok=True)
    images = (load_digits().images.reshape(-1, 64) / 16.0).astype(np.float32)
    n = len(images)
    ids = [f"d-{i:05d}" for i in range(n)]
    for f, rows in enumerate(np.array_split(np.arange(n), FILES)):
        table = pa.table({
            "id": pa.array([ids[i] for i in rows], pa.string()),
            "pixels": pa.FixedSizeListArray.from_arrays(pa.array(images[rows].reshape(-1)), 64),
            "mirror": pa.FixedSizeListArray.from_arrays(
                pa.array(np.ascontiguousarray(images[rows][:, ::-1]).reshape(-1)), 64
            ),
        })
        tmp = out / "digits" / f".part-{f}.tmp"
        pq.write_table(table, tmp, row_group_size=100)
        os.replace(tmp, out / "digits" / f"part-{f}.parquet")

    torch.manual_seed(5)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
    ).eval()
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 8 * 8, 10),
    ).eval()

    class Out3d(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 16)

        def forward(self, x):
            return self.fc(x).view(x.shape[0], 2, 8)

    class Multi(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU())
            self.head = torch.nn.Linear(32, 10)

        def forward(self, x):
            embedding = self.body(x)
            return {"logits": self.head(embedding), "embedding": embedding}

    multi = Multi().eval()

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 10)
            self.b = torch.nn.Linear(64, 10)

        def forward(self, x, y):
            return self.a(x) - self.b(y)

    two = Two().eval()
    torch.jit.script(mlp).save(str(out / "mlp.pt"))
    torch.jit.script(Out3d().eval()).save(str(out / "out3d.pt"))
    export_package(mlp, torch.randn(64, 64), out / "mlp.pt2")
    # The example batch matters: AOTInductor bounds the batch of a CPU conv by
    # the example's size (an example of 8 compiles a package that takes at
    # most 15), so the example is a batch as the jobs give it.
    export_package(cnn, torch.randn(64, 1, 8, 8), out / "cnn.pt2")
    export_package(multi, torch.randn(64, 64), out / "multi.pt2")
    export_package(two, (torch.randn(64, 64), torch.randn(64, 64)), out / "two.pt2")
    rewrite_device(out / "mlp.pt2", out / "mlp_cuda.pt2", "cuda")
    data = (out / "mlp.pt2").read_bytes()
    (out / "corrupt.pt2").write_bytes(data[: len(data) // 2])

    x = torch.from_numpy(images)
    reference = {}
    with torch.inference_mode():
        for name, shape in [("mlp.pt2", (-1, 64)), ("cnn.pt2", (-1, 1, 8, 8))]:
            runner = torch._inductor.aoti_load_package(str(out / name))
            chunks = [runner(c.reshape(shape)) for c in torch.split(x, MAX_BATCH)]
            reference[name] = torch.cat(chunks).numpy()
        runner = torch._inductor.aoti_load_package(str(out / "two.pt2"))
        mirror = torch.from_numpy(np.ascontiguousarray(images[:, ::-1]))
        reference["two.pt2"] = torch.cat([
            runner(a, b) for a, b in zip(torch.split(x, MAX_BATCH), torch.split(mirror, MAX_BATCH))
        ]).numpy()
        runner = torch._inductor.aoti_load_package(str(out / "multi.pt2"))
        chunks = [runner(c) for c in torch.split(x, MAX_BATCH)]
        reference["multi.pt2"] = torch.cat([c["logits"] for c in chunks]).numpy()
        reference["multi.pt2:embedding"] = torch.cat([c["embedding"] for c in chunks]).numpy()
        reference["mlp.pt"] = torch.jit.load(str(out / "mlp.pt"))(x).numpy()
        # What `flatten_outputs = true` makes of out3d's [B, 2, 8]: [B, 16].
        reference["out3d.pt"] = torch.jit.load(str(out / "out3d.pt"))(x).reshape(n, -1).numpy()
    (out / "reference.json").write_text(json.dumps({
        name: {
            ids[i]: {"argmax": int(s[i].argmax()), "scores": [float(v) for v in s[i]]}
            for i in range(n)
        }
        for name, s in reference.items()
    }))
    marker.write_text(VERSION)


if __name__ == "__main__":
    main()
