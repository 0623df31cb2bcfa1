"""A stoke worker in a Python process: ``python -m stoke._worker
--coordinator ADDR ...`` takes the ``stoke-worker`` command line and runs
Python processors in this interpreter. It is the ``stoke-worker`` command
of a pip install, and what ``torch_batch_process(..., workers=N)`` starts;
the process exits when the worker stops, with the binary's exit codes."""

import sys

from . import _host


def main() -> None:
    _host.prepare()
    _host.IN_WORKER = True
    from . import _native

    _native.worker_main(["stoke-worker", *sys.argv[1:]])


if __name__ == "__main__":
    main()
