"""A Determined-style processor over JSON Lines for the JSON-types tests
(python/tests/test_json_types.py): a float32 TorchScript model on the
``features`` column, as a new user writes it, plus what each column's
tensor type was, so the tests can check what reached Python."""

import torch

from stoke import TorchBatchProcessor


def dtype_name(value):
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return "list of " + str(value[0].dtype)
    return type(value).__name__


class Predict(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(torch.jit.load(context.params["model"]))
        # Cast the input to the model's float32 (what a user does once the
        # input is float64 on purpose).
        self.cast = bool(context.params.get("cast", False))

    def process_batch(self, batch, batch_idx):
        n = len(batch.ids)
        features = batch["features"]
        x = self.context.to_device(features)
        with torch.no_grad():
            scores = self.model(x.float() if self.cast else x)
        padded, lengths = batch.padded("ragged")
        user_ids = batch["user_id"]
        if isinstance(user_ids, torch.Tensor):
            user_ids = [str(u) for u in user_ids.tolist()]
        self.context.write_rows({
            "id": batch.ids,
            "scores": scores,
            "user_id": user_ids,
            "features_dtype": [dtype_name(features)] * n,
            "ragged_dtype": [dtype_name(batch["ragged"])] * n,
            "padded_dtype": [str(padded.dtype)] * n,
            "score_dtype": [dtype_name(batch["score"])] * n,
            "count_dtype": [dtype_name(batch["count"])] * n,
        })
