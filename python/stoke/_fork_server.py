"""Imported by stoke's fork server only (it is in the server's preload
list; see ``stoke._loading``), never by a user's process.

When its parent ends, the fork server leaves with ``os._exit`` instead
of finalising an interpreter that has torch imported: that teardown
takes about half a second, and the server holds the worker's output
pipe, so ``stoke run`` would wait for it after every job. The server
holds no state to save. Its children (load processes, DataLoader
workers) leave through ``os._exit`` already and never run this.

Its children die with it, however the worker above it dies:

- The server stops when the read end of its "alive" pipe sees EOF, that
  is when every holder of the write end is gone. multiprocessing hands a
  copy of that write end to every child it forks, so a load process or
  DataLoader worker kept the server up, and the server kept them up (a
  DataLoader worker waits for its parent to change; a load process for a
  call queue whose write end it holds itself): after a worker's kill -9
  they ran for ever. Each child closes its copy at once here.
- Each child asks the kernel for SIGKILL when the server ends
  (``PR_SET_PDEATHSIG``; the server is single-threaded, so its one
  thread is its life). That setting is not inherited across fork, which
  is why each child sets it itself, from the server's after-fork hooks.

Not a public module.
"""

import atexit
import os
import sys
from multiprocessing import util

_SERVER_PID = os.getpid()
# The worker that started the server, noted first thing (before torch is
# imported): by the time a later module asks, it may be gone.
PARENT_PID = os.getppid()
_PR_SET_PDEATHSIG = 1


def _leave_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (a closed stream: nothing to flush)
            pass
    os._exit(0)


def _die_with_server() -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    # The server may have gone between the fork and the line above.
    if os.getppid() != _SERVER_PID:
        os._exit(1)


def _close_alive_pipe() -> None:
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        # A process this child starts from a fork server starts its own.
        server._forkserver_alive_fd = None
        server._forkserver_address = None
        server._forkserver_pid = None


class _Hook:
    """What ``util.register_after_fork`` keeps a weak reference to."""


def _in_child(_hook: _Hook) -> None:
    if os.getpid() == _SERVER_PID:
        return
    _die_with_server()
    _close_alive_pipe()


_HOOK = _Hook()
# Copied into each child by the fork; run there by multiprocessing's
# bootstrap before the child's target.
util.register_after_fork(_HOOK, _in_child)

# Registered first among the server's handlers, so it runs last of them
# (atexit runs handlers in reverse order), after any a preloaded module adds.
atexit.register(_leave_now)
