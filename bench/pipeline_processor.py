"""The processors of bench/pipeline.py (issue 49): an image workload where
preprocessing dominates (decode, 12 Gaussian blurs, resize to 64x64),
then a small CNN.

- ``DecodeClassify``: one pool; each worker decodes for itself with
  ``load_fn`` on its load processes, then runs the model.
- ``Decode``: the first stage of the two-pool pipeline; writes each
  image's pixels (``pixels``, 3x64x64 float32, flat) for the classify
  stage (the built-in TorchScript runner) on the other pool.
"""

import io
import pathlib
import time

import torch
# What load_fn uses, imported at the top as Graphbook's steps do.
import torchvision.transforms.functional as F
from PIL import Image

from stoke import TorchBatchProcessor

SIDE = 64
BLURS = 12


def preprocess(data):
    """Decode one PNG, 12 Gaussian blurs (9x9), resize to SIDE x SIDE."""
    tensor = F.to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))
    for _ in range(BLURS):
        tensor = F.gaussian_blur(tensor, kernel_size=[9, 9])
    return F.resize(tensor, [SIDE, SIDE], antialias=True)


def model(path):
    return torch.jit.load(str(path))


class DecodeClassify(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(model(context.params["model_path"]))

    @staticmethod
    def load_fn(item):
        return preprocess(item["bytes"])

    def process_batch(self, batch, batch_idx):
        # The forward pass alone, timed: this processor's time in
        # process_batch also holds its wait for the load processes.
        started = time.perf_counter()
        with torch.no_grad():
            pred = self.model(self.context.to_device(batch.collated)).argmax(1)
        each = (time.perf_counter() - started) / len(batch.ids)
        self.context.write_rows({"id": batch.ids, "prediction": pred, "model_s": [each] * len(batch.ids)})


class Decode(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    @staticmethod
    def load_fn(item):
        return preprocess(item["bytes"])

    def process_batch(self, batch, batch_idx):
        self.context.write_rows({"id": batch.ids, "pixels": batch.collated.flatten(1)})


def export_model(path):
    """The CNN of bench/images.py as TorchScript (fixed seed)."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import images

    torch.jit.script(images.get_model().eval()).save(str(path))
