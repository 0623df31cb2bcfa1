"""Contender (c) of bench/images.py: Graphbook's load_fn (decode and
transform one PNG) on stoke's load processes, then the CNN. ``Predict``
reads ``batch.collated`` (the load process's batch, no copy);
``PredictStack`` is Graphbook's step as written, with
``torch.stack(batch.samples)``. ``Blurred`` is issue 48's loading-bound
step: ``Predict`` with 12 Gaussian blurs per record in ``load_fn``."""

import sys
import pathlib

import torch
# What load_fn uses, imported here as Graphbook's steps do: stoke's fork
# server imports this module once for all the load processes.
import torchvision.transforms.functional  # noqa: F401
from PIL import Image  # noqa: F401

from stoke import TorchBatchProcessor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import images  # noqa: E402


class Predict(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(images.get_model())

    @staticmethod
    def load_fn(item):
        return images.transform_bytes(item["bytes"])

    def process_batch(self, batch, batch_idx):
        with torch.no_grad():
            pred = self.model(self.context.to_device(batch.collated)).argmax(1)
        self.context.write_rows({"id": batch.ids, "prediction": pred})


class PredictStack(Predict):
    def process_batch(self, batch, batch_idx):
        with torch.no_grad():
            pred = self.model(self.context.to_device(torch.stack(batch.samples))).argmax(1)
        self.context.write_rows({"id": batch.ids, "prediction": pred})


class Blurred(Predict):
    @staticmethod
    def load_fn(item):
        return images.blurred_bytes(item["bytes"])
