"""A stoke worker in a Python process: ``python -m stoke._worker
--coordinator ADDR ...`` takes the ``stoke-worker`` command line and runs
Python processors in this interpreter. What ``torch_batch_process(...,
workers=N)`` starts; the process exits when the worker stops."""

import sys

# torch first: it loads libtorch, which the compiled module links to.
import torch  # noqa: F401

from . import _dataset, _native


def main() -> None:
    # A worker process: DataLoader workers start from a fork server, not
    # by forking this multi-threaded process.
    _dataset.IN_WORKER = True
    _native.worker_main(["stoke-worker", *sys.argv[1:]])


if __name__ == "__main__":
    main()
