"""Imported by stoke's fork server only (it is in the server's preload
list; see ``stoke._loading``), never by a user's process.

When its parent ends, the fork server leaves with ``os._exit`` instead
of finalising an interpreter that has torch imported: that teardown
takes about half a second, and the server holds the worker's output
pipe, so ``stoke run`` would wait for it after every job. The server
holds no state to save. Its children (load processes, DataLoader
workers) leave through ``os._exit`` already and never run this.

Not a public module.
"""

import atexit
import os
import sys


def _leave_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 (a closed stream: nothing to flush)
            pass
    os._exit(0)


# Registered first among the server's handlers, so it runs last of them
# (atexit runs handlers in reverse order), after any a preloaded module adds.
atexit.register(_leave_now)
