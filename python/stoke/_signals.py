"""Signals while a job runs in this process (``torch_batch_process``, in
this process or with local workers): SIGTERM stops the job as Ctrl-C
does, instead of killing the process.

Not a public module.
"""

from __future__ import annotations

import os
from typing import Any


class stop_on_signals:
    """While a job runs in this process, SIGTERM stops it as Ctrl-C does
    (checkpoint after the current batch, pause, :class:`JobPaused`)
    instead of killing the process. Python runs signal handlers only when
    the main thread runs Python, which it does not while the job runs; so
    the signal is also written to a FIFO (``signal.set_wakeup_fd``) that
    the job's Rust side reads, and stops at once. The previous handler
    and wake-up fd come back after."""

    def __init__(self, fifo: bool = True) -> None:
        self._fifo = fifo

    def __enter__(self) -> "stop_on_signals":
        import signal
        import tempfile
        import threading

        self.path = None
        self._old = None
        if threading.current_thread() is not threading.main_thread():
            return self
        if not self._fifo:
            self._old = signal.signal(signal.SIGTERM, _raise_stop)
            return self
        self._dir = tempfile.mkdtemp(prefix="stoke-signals-")
        self.path = os.path.join(self._dir, "wakeup")
        os.mkfifo(self.path)
        # The read end first (non-blocking, so opening does not wait for a
        # writer), then the write end the signal handler writes to.
        self._rfd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._wfd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        self._old_fd = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        self._old = signal.signal(signal.SIGTERM, _raise_stop)
        return self

    def __exit__(self, *exc: Any) -> None:
        import shutil
        import signal

        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
        if self.path is None:
            return
        signal.set_wakeup_fd(self._old_fd)
        # Closing the write end ends the Rust side's reader.
        os.close(self._wfd)
        os.close(self._rfd)
        shutil.rmtree(self._dir, ignore_errors=True)


def _raise_stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
