"""A processor for the tests of batch columns as tensors: JSON Lines rows
with ``features`` (48 floats each) and ``tokens`` (ragged ints)."""

import torch

from stoke import TorchBatchProcessor


class Shapes(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.model = context.prepare_model_for_inference(torch.nn.Linear(48, 2))

    def process_batch(self, batch, batch_idx):
        features = self.context.to_device(batch["features"])
        assert isinstance(features, torch.Tensor) and features.shape == (len(batch), 48), features
        # JSON floats: torch's default dtype (issue 45), as the model's.
        assert features.dtype == torch.get_default_dtype() == torch.float32
        with torch.no_grad():
            scores = self.model(features)
        tokens = batch["tokens"]
        assert isinstance(tokens, list) and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in tokens)
        padded, lengths = batch.padded("tokens", -1)
        assert padded.shape == (len(batch), int(lengths.max()))
        for row, n, t in zip(padded, lengths, tokens):
            assert torch.equal(row[:n], t) and bool((row[n:] == -1).all())
        fixed, fixed_lengths = batch.padded("features")
        assert fixed is batch["features"] and bool((fixed_lengths == 48).all())
        self.context.write_rows({
            "id": batch.ids,
            "first": features[:, 0],
            "length": lengths,
            "token_sum": torch.stack([t.sum() for t in tokens]),
            "score": scores[:, 0],
        })
