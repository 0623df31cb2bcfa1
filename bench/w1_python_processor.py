"""W1 through a Python processor doing what the built-in runner does for
`outputs = ["argmax"]`: the same TorchScript model on the `features`
column, one row per record (id, prediction). bench/run.sh python runs it
side by side with the built-in runner and with plain Python."""

import torch
from stoke import TorchBatchProcessor


class W1Processor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        model = torch.jit.load(context.fetch(context.params["model"]))
        self.model = context.prepare_model_for_inference(model)

    def process_batch(self, batch, batch_idx):
        x = self.context.to_device(batch["features"])
        with torch.no_grad():
            pred = self.model(x).argmax(1)
        self.context.write_rows({"id": batch.ids, "prediction": pred})
