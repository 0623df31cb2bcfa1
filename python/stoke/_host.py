"""What a process needs before it runs the worker or embedded mode in this
interpreter (``python -m stoke._worker``, ``python -m stoke._embedded``):
the ``stoke-worker`` and ``stoke-embedded`` commands of a pip install, and
the local workers of ``torch_batch_process(..., workers=N)``.

A cargo-built ``stoke-worker`` binary does the same before ``main`` (its
``.preinit_array`` entries, ``worker/src/signals.rs`` and
``worker/src/cli.rs``); here it is done before ``stoke._native`` loads
libtorch:

- the OpenMP wait settings (``stoke_core::OPENMP_WAIT``: spin about 0.1 ms,
  then sleep), unless the user set either: libgomp reads them once, when it
  loads, and the worker would otherwise start this process again to set
  them;
- SIGTERM and SIGINT blocked until the worker listens for them (it
  unblocks them then): one that arrives during libtorch's start-up (a pod
  preempted while starting) waits and stops the worker cleanly, rather
  than killing it;
- ``STOKE_DEFAULT_PYTHON``: the Python that the worker's Python processes
  (the fork server of load processes, probes) run in, this one;
- libtorch: ``stoke._native`` finds torch's ``lib`` beside it in
  ``site-packages`` (its rpath); when torch is installed elsewhere
  (``--system-site-packages``), ``import torch`` loads it first.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys

# `threading` takes the thread that first imports it for the main thread:
# imported here, that is this process's real main thread, not the worker's
# processor thread that first runs Python code. torch's DataLoader asks
# `threading` whether it runs on the main thread before it sets a SIGCHLD
# handler, which CPython refuses anywhere else ("signal only works in main
# thread").
import threading  # noqa: F401

# This process is a worker (python -m stoke._worker): DataLoader workers
# start from a fork server, not by forking this multi-threaded process
# (read by stoke._dataset, which the worker imports only when a Python
# processor needs it).
IN_WORKER = False

# stoke_core::OPENMP_WAIT (core/src/lib.rs): both, unless the user set either.
OPENMP_WAIT = (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "10000"))


def _torch_beside() -> bool:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.isdir(os.path.join(os.path.dirname(here), "torch", "lib"))


def prepare() -> None:
    """Call before importing ``stoke._native``."""
    if not any(name in os.environ for name, _ in OPENMP_WAIT):
        os.environ.update(OPENMP_WAIT)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    os.environ.setdefault("STOKE_DEFAULT_PYTHON", sys.executable)
    if not _torch_beside() and importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401
