# Step 1 of Determined's "How To Perform Batch (Offline) Inference", as the
# document has it; only the import line is changed (was
# `from determined.pytorch.experimental import TorchBatchProcessor`).
import pathlib

import torch

from stoke import TorchBatchProcessor


def get_model():
    # The tutorial's model: here a TorchScript model next to this file.
    return torch.jit.load(str(pathlib.Path(__file__).with_name("digits_model.pt")))


"""
Define custom processor class
"""
class InferenceProcessor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(get_model())
        self.output = []
        self.last_index = 0

    def process_batch(self, batch, batch_idx) -> None:
        model_input = batch[0]
        model_input = self.context.to_device(model_input)

        with torch.no_grad():
            with self.profiler as p:
                pred = self.model(model_input)
                p.step()
                output = {"predictions": pred, "input": batch}
                self.output.append(output)

        self.last_index = batch_idx

    def on_checkpoint_start(self):
        # During checkpoint, we persist prediction result
        if len(self.output) == 0:
            return
        file_name = f"prediction_output_{self.last_index}"
        with self.context.upload_path() as path:
            file_path = pathlib.Path(path, file_name)
            torch.save(self.output, file_path)

        self.output = []
