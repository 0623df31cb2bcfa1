# The book's Python processor (docs/src/getting-started/python.md), on the
# demo's digits: scripts/wheel-test.sh and scripts/image.sh copy it into
# their jobs' folders as my_processor.py.
import torch
from stoke import TorchBatchProcessor


class InferenceProcessor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        model = torch.jit.load(context.fetch(context.params["model"]))
        self.model = context.prepare_model_for_inference(model)

    def process_batch(self, batch, batch_idx):
        x = self.context.to_device(batch["pixels"])
        with torch.no_grad():
            pred = self.model(x).argmax(1)
        self.context.write_rows({"id": batch.ids, "prediction": pred})
