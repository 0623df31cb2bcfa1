"""stoke: distributed batch processing for PyTorch.

The processor API (what a worker runs)::

    from stoke import TorchBatchProcessor, MetricReducer

and, from the compiled part of the package, :class:`Client` (talks to a
coordinator) and :func:`torch_batch_process` (runs a job in this process).
"""

from __future__ import annotations

from typing import Any

from ._reducer import MetricReducer
from ._runtime import Batch, Context
from .processor import BadRecord, TorchBatchProcessor

__all__ = [
    "BadRecord",
    "Batch",
    "Context",
    "Client",
    "JobPaused",
    "MetricReducer",
    "StokeError",
    "TorchBatchProcessor",
    "torch_batch_process",
    "__version__",
]

__version__ = "0.1.0"

# Client, torch_batch_process and StokeError live in the compiled module,
# which links stoke's worker and libtorch; import it only when asked, so a
# worker importing the processor API never loads a second copy of itself.
_NATIVE = {"Client", "JobPaused", "StokeError", "torch_batch_process"}


def __getattr__(name: str) -> Any:
    if name in _NATIVE:
        from . import _api

        return getattr(_api, name)
    raise AttributeError(f"module 'stoke' has no attribute {name!r}")
