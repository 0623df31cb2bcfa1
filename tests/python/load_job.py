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


class Collated(Squares):
    """``batch.collated`` against the samples: per record, whether the
    batch is in shared memory, whether the first sample lies at its
    address (a view, no copy) and whether it equals the samples stacked."""

    def process_batch(self, batch, batch_idx):
        collated = batch.collated
        n = len(batch.ids)
        self.context.write_rows({
            "id": batch.ids,
            "x": collated[:, 0].long(),
            "size": [n] * n,
            "shared": [collated.is_shared()] * n,
            "view": [batch.samples[0].data_ptr() == collated.data_ptr()] * n,
            "equal": [bool(torch.equal(collated, torch.stack(batch.samples)))] * n,
        })


class CollatedDicts(TorchBatchProcessor):
    """``load_fn`` returns a dict (a tensor and a string):
    ``batch.collated`` is what torch's ``default_collate`` makes of it."""

    def __init__(self, context):
        self.context = context

    @staticmethod
    def load_fn(item):
        return {"x": torch.tensor(float(item["x"])), "name": f"n{item['x']}"}

    def process_batch(self, batch, batch_idx):
        from torch.utils.data import default_collate

        collated = batch.collated
        want = default_collate(batch.samples)
        assert sorted(collated) == ["name", "x"], sorted(collated)
        assert torch.equal(collated["x"], want["x"]) and collated["name"] == want["name"]
        self.context.write_rows({"id": batch.ids, "x": collated["x"].long(), "name": collated["name"]})


class LookAhead(TorchBatchProcessor):
    """How far the load processes run ahead of the model. ``load_fn``
    leaves a file per record in the record's ``dir``; ``process_batch``
    writes, with each record, the records loaded but not yet processed
    when its batch began (for the first batch, the most seen while it
    waits up to 2 s for the load processes to run further ahead)."""

    def __init__(self, context):
        self.context = context
        self.processed = 0

    @staticmethod
    def load_fn(item):
        open(os.path.join(item["dir"], item["id"]), "w").close()
        return torch.tensor([float(item["x"])])

    def process_batch(self, batch, batch_idx):
        import time

        folder = batch["dir"][0]
        lead = len(os.listdir(folder)) - self.processed
        if self.processed == 0:
            # Unbounded, every record of the job would be loaded by now.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                lead = max(lead, len(os.listdir(folder)) - self.processed)
                time.sleep(0.05)
        self.processed += len(batch.ids)
        self.context.write_rows({"id": batch.ids, "x": batch.collated[:, 0].long(), "lead": [lead] * len(batch.ids)})


class AcrossShards(TorchBatchProcessor):
    """Whether the next shard's records reach the load processes before
    this shard ends. ``load_fn`` leaves a file per record in the record's
    ``dir``; ``process_batch`` writes what it got. At each shard's last
    checkpoint (its only one, at the default interval) ``on_checkpoint_start``
    notes in ``dir`` how many records were loaded beyond those processed,
    having waited (up to 2 s) for at least one while any record is left:
    more than 0 means records of a later shard were loaded while this one
    was still running."""

    def __init__(self, context):
        self.context = context
        self.processed = 0
        self.folder = None

    @staticmethod
    def load_fn(item):
        open(os.path.join(item["dir"], item["id"]), "w").close()
        return torch.tensor([float(item["x"])])

    def process_batch(self, batch, batch_idx):
        self.folder = batch["dir"][0]
        self.processed += len(batch.ids)
        self.context.write_rows({"id": batch.ids, "x": batch.collated[:, 0].long()})

    def on_checkpoint_start(self):
        import time

        if self.folder is None:
            return
        total = int(self.context.params["records"])

        def loaded():
            return sum(1 for name in os.listdir(self.folder) if not name.startswith("lead-"))

        deadline = time.monotonic() + 2.0
        while self.processed < total and loaded() <= self.processed and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(os.path.join(self.folder, f"lead-{self.context.shard}"), "w") as f:
            f.write(str(loaded() - self.processed))


class Doomed(Squares):
    """``Squares`` whose worker dies while its load processes run: by
    SIGKILL once, at batch ``kill_at`` (the file ``marker`` records that it
    happened, so the batch's next attempt goes on), and by ``abort()`` on
    each record id in ``poison`` (a record that kills its worker, which the
    coordinator isolates). ``delay``: seconds each batch takes."""

    def __init__(self, context):
        super().__init__(context)
        params = context.params
        self.kill_at = params.get("kill_at", -1)
        self.marker = params.get("marker")
        self.poison = set(params.get("poison", []))
        self.delay = float(params.get("delay", 0.0))

    def process_batch(self, batch, batch_idx):
        if self.marker and batch_idx == self.kill_at and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        if self.poison.intersection(batch.ids):
            os.abort()
        if self.delay:
            import time

            time.sleep(self.delay)
        super().process_batch(batch, batch_idx)
