"""The processor API: subclass :class:`TorchBatchProcessor` (the same
shape as Determined's ``determined.pytorch.experimental.TorchBatchProcessor``).
"""

from __future__ import annotations

from typing import Any


class BadRecord(Exception):
    """Raise from ``process_batch`` to leave one record out.

    Under the job's ``errors.policy = "skip"`` the record is written under
    the job's ``errors/`` with ``reason``, counted, and the batch is run
    again without it (rows written by the failed call are discarded); under
    ``"fail"`` (the default) it fails the attempt, naming the record.
    """

    def __init__(self, record_id: str, reason: str) -> None:
        super().__init__(f"bad record {record_id}: {reason}")
        self.record_id = str(record_id)
        self.reason = str(reason)


class _NoProfiler:
    """What ``self.profiler`` is until a processor sets its own (for
    example a ``torch.profiler.profile``): a context manager whose
    ``step()`` does nothing, so code written for Determined's profiler runs
    unchanged."""

    def __enter__(self) -> "_NoProfiler":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def step(self) -> None:
        return None


class TorchBatchProcessor:
    """A user's per-batch logic. One instance per worker device and job.

    ``__init__(self, context)`` loads the model once; ``process_batch``
    runs for every batch of every shard the worker is given;
    ``on_checkpoint_start`` flushes anything buffered (rows, files in
    ``context.upload_path()``) before the checkpoint's outputs are
    uploaded; ``on_finish`` runs once when no work is left.
    """

    profiler: Any = _NoProfiler()

    def __init__(self, context: Any) -> None:
        self.context = context

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define process_batch(self, batch, batch_idx)")

    def on_checkpoint_start(self) -> None:
        return None

    def on_finish(self) -> None:
        return None
