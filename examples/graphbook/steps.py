"""Graphbook's "Batch Data" guide on stoke: its ``LoadImages`` step (a
``load_fn`` run per image on a pool of load processes) and its
``MyMLModel`` step (stack the tensors, run the model), as one stoke
processor over a folder of PNG files.

Graphbook hands ``load_fn`` an item whose ``"value"`` is an image path;
stoke's ``files`` dataset hands it the object itself, ``item["uri"]`` and
``item["bytes"]``, so ``Image.open`` reads the bytes (on any store, not
only a local disk). The model is a resource in Graphbook; here it is made
in ``__init__``.

    python make_images.py images 2000
    stoke run --local 2 job.toml
    python -c "import stoke, steps; stoke.torch_batch_process(steps.MyMLModel, 'job.toml', workers=2)"
"""

import io
from typing import List

import torch
import torchvision.transforms.functional as F
from PIL import Image

from stoke import TorchBatchProcessor   # was: from graphbook.steps import BatchStep


def get_model():
    # The same weights in every process: the tests recompute predictions.
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 10),
    )


class MyMLModel(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(get_model())

    # LoadImages: custom defined function that will execute in parallel
    @staticmethod
    def load_fn(item: dict) -> torch.Tensor:
        pil_image = Image.open(io.BytesIO(item["bytes"]))
        return F.to_tensor(pil_image)

    # MyMLModel: the loaded tensors, in record order
    @torch.no_grad()
    def process_batch(self, batch, batch_idx):
        images: List[torch.Tensor] = batch.samples
        stacked = self.context.to_device(torch.stack(images))
        outputs = self.model(stacked)
        self.context.write_rows({"id": batch.ids, "prediction": outputs.argmax(1), "scores": outputs})
