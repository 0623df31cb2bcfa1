"""The image pipeline of tests/tests/pipelines.rs: PNG files decoded and
resized on a CPU pool's worker, a small CNN on a GPU pool's worker (a CPU
process in the tests), against the same work in one stage.

    python pipeline_images.py FOLDER COUNT   # COUNT PNGs and model.pt in FOLDER
"""

import io
import pathlib
import sys

import numpy as np
import torch
from PIL import Image

from stoke import TorchBatchProcessor

# The size images are resized to, and what the model takes.
SIDE = 16


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * (SIDE // 2) * (SIDE // 2), 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.fc(x.flatten(1))


def make(folder, count):
    """COUNT PNGs of varied sizes (deterministic), and the CNN as
    TorchScript (fixed seed) beside them."""
    folder = pathlib.Path(folder)
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    for i in range(count):
        h, w = int(rng.integers(20, 40)), int(rng.integers(20, 40))
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f"img-{i:04d}.png")
    torch.manual_seed(7)
    torch.jit.script(Net().eval()).save(str(folder / "model.pt"))


def decode(data):
    """One PNG's bytes as a [3, SIDE, SIDE] float32 tensor in [0, 1]."""
    image = Image.open(io.BytesIO(data)).convert("RGB").resize((SIDE, SIDE), Image.BILINEAR)
    array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class Decode(TorchBatchProcessor):
    """The first stage: each file's pixels, flat, keyed by its uri."""

    def __init__(self, context):
        self.context = context

    def process_batch(self, batch, batch_idx):
        pixels = torch.stack([decode(b) for b in batch["bytes"]])
        self.context.write_rows({"id": batch.ids, "pixels": pixels.flatten(1)})


class DecodeClassify(TorchBatchProcessor):
    """The same work in one stage: decode, then the model, writing what
    the built-in runner writes (`prediction`, `scores`)."""

    def __init__(self, context):
        self.context = context
        self.model = torch.jit.load(context.fetch(context.params["model"]))

    def process_batch(self, batch, batch_idx):
        pixels = torch.stack([decode(b) for b in batch["bytes"]])
        with torch.no_grad():
            scores = self.model(pixels)
        self.context.write_rows({"id": batch.ids, "prediction": scores.argmax(1), "scores": scores})


if __name__ == "__main__":
    make(sys.argv[1], int(sys.argv[2]))
