"""A Graphbook-style processor for the tests: ``load_fn`` runs per record
on the load processes; ``process_batch`` writes what it got.

Records come from a JSON Lines file with ``id``, ``x`` and ``fault``.
``load_fn`` returns ``[x, x*x, pid]``; it raises where ``fault`` is
``"raise"`` and kills its own process where it is ``"die"``."""

import os
import signal

import torch

from stoke import TorchBatchProcessor


class Squares(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context

    @staticmethod
    def load_fn(item):
        x = int(item["x"])
        if item["fault"] == "raise":
            raise ValueError(f"cannot load x={x}")
        if item["fault"] == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([float(x), float(x * x), float(os.getpid())])

    def process_batch(self, batch, batch_idx):
        assert len(batch.samples) == len(batch.ids)
        stacked = torch.stack(batch.samples)
        self.context.write_rows({
            "id": batch.ids,
            "x": stacked[:, 0].long(),
            "square": stacked[:, 1].long(),
            "pid": stacked[:, 2].long(),
        })


class FileDigests(TorchBatchProcessor):
    """Over a ``files`` dataset: ``load_fn`` gets each file's ``uri`` and
    ``bytes`` and returns ``[len, crc32, pid]``; ``process_batch`` writes
    them with the CRC of the batch's own ``bytes`` column."""

    def __init__(self, context):
        self.context = context

    @staticmethod
    def load_fn(item):
        import zlib

        assert sorted(item) == ["bytes", "uri"], sorted(item)
        return torch.tensor([len(item["bytes"]), zlib.crc32(item["bytes"]), os.getpid()], dtype=torch.int64)

    def process_batch(self, batch, batch_idx):
        import zlib

        stacked = torch.stack(batch.samples)
        self.context.write_rows({
            "id": batch.ids,
            "size": stacked[:, 0],
            "crc": stacked[:, 1],
            "pid": stacked[:, 2],
            "column_crc": torch.tensor([zlib.crc32(b) for b in batch["bytes"]], dtype=torch.int64),
        })
