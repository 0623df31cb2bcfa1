"""stoke: distributed batch processing for PyTorch.

Two distributions make this package:

- ``stoke-client`` (no torch): :class:`Client` (talks to a coordinator),
  the exceptions, and the ``stoke`` and ``stoke-coordinator`` commands;
- ``stoke`` (depends on ``stoke-client`` and torch): the processor API (what
  a worker runs)::

      from stoke import TorchBatchProcessor, MetricReducer

  :func:`torch_batch_process` (runs a job in this process) and the
  ``stoke-worker`` command.

Everything is imported when first used, so ``import stoke`` (and every
``stoke`` command, which starts from here) stays cheap, and a client-only
install says what to install when a worker-side name is asked for.
"""

from __future__ import annotations

import importlib

# `typing` only for the annotations (postponed): importing it costs every
# command and worker start about 10 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

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

# Where each public name lives. The first three modules are the
# `stoke-client` distribution's; the others are the `stoke` distribution's.
# torch_batch_process lives in the compiled module that links stoke's worker
# and libtorch: imported only when asked, so a worker importing the
# processor API never loads a second copy of itself.
_WHERE = {
    "Client": "_client",
    "StokeError": "_client",
    "JobPaused": "_client",
    "MetricReducer": "_reducer",
    "Batch": "_runtime",
    "Context": "_runtime",
    "BadRecord": "processor",
    "TorchBatchProcessor": "processor",
    "torch_batch_process": "_api",
}
_CLIENT_MODULES = {"_client"}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'stoke' has no attribute {name!r}")
    try:
        found = importlib.import_module(f".{module}", __name__)
    except ModuleNotFoundError as e:
        if module in _CLIENT_MODULES or e.name != f"{__name__}.{module}":
            raise
        raise ImportError(
            f"stoke.{name} is part of the `stoke` distribution (the worker side, with torch); "
            "this is a client-only install (`stoke-client`): pip install stoke"
        ) from e
    value = getattr(found, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
