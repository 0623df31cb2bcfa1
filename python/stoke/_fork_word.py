"""The word a fork server started ahead of its job waits for.

A worker started for jobs with load processes starts its fork server
before its own ``import torch`` (``stoke._loading.start_fork_server``),
so the two imports run side by side. The job's ``load_fn``, and so the
module it comes from, is not known yet then. Imported last in that
server's preload, this module waits for the worker's word: the modules
to import (``load_fn``'s) and the worker's ``sys.path`` (the server
imports ``stoke._fork_wait``, which calls ``wait``). The server then
imports them before it forks any load process, so what they import (a
second of CPU for torchvision) is imported once, not once per process.

The word is a file in a folder only this user can write to, named for
the worker's pid (the server's parent, named in its preload list): the
worker makes the folder
before it starts the server, and writes the file whole (a rename) when
it knows the job. The server waits until then, or until its parent is
gone (then it leaves, as it would have at once). A word that cannot be
read, or a module that does not import, is passed over: each load
process imports what it needs itself, as without the word, and reports
its own errors.

Not a public module.
"""

import json
import os
import select
import shutil
import stat
import sys
import tempfile
import time

_NAME = "word"


def folder_for(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"stoke-fork-word-{pid}")


def make_folder() -> str | None:
    """In the worker, before it starts the server: the empty folder the
    server will wait on, or ``None`` where it cannot be made this user's
    alone (the server then does not wait)."""
    folder = folder_for(os.getpid())
    try:
        if os.path.lexists(folder):
            # Left by an earlier process with this pid: ours to remove,
            # never another user's.
            if os.lstat(folder).st_uid != os.getuid():
                return None
            shutil.rmtree(folder)
        os.mkdir(folder, 0o700)
    except OSError:
        return None
    return folder


def write(folder: str, word: str) -> None:
    """In the worker: says the word (whole, or not at all)."""
    part = os.path.join(folder, f".{_NAME}")
    try:
        with open(part, "w") as f:
            f.write(word)
        os.replace(part, os.path.join(folder, _NAME))
    except OSError:
        # The server has gone (and took the folder): nothing waits.
        pass


def _trusted(folder: str) -> bool:
    info = os.lstat(folder)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


# In the server's preload list after ``stoke._fork_wait``, naming the
# worker whose word it waits for (not a module: the server's import of it
# fails, and the server passes over a preload module that fails).
_FOR = "stoke._fork_word_for_"


def preload_entry(pid: int) -> str:
    return f"{_FOR}{pid}"


def _server_main() -> dict:
    """The locals of ``multiprocessing.forkserver.main``, which is
    importing its preload modules (this one among them)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return frame.f_locals
        frame = frame.f_back
    return {}


def wait() -> None:
    """In the fork server, in its preload: waits for the word and imports
    what it names; leaves when the worker is gone first. The server's
    ``main`` holds the worker's pid (in the preload list) and the read end
    of its "alive" pipe (``alive_r``), which sees EOF once the worker is
    gone, however it went."""
    from stoke import _fork_server

    server = _server_main()
    named = [m for m in server.get("preload", []) if isinstance(m, str) and m.startswith(_FOR)]
    parent = int(named[0][len(_FOR):]) if named else _fork_server.PARENT_PID
    folder = folder_for(parent)
    alive = server.get("alive_r")
    alive = alive if isinstance(alive, int) else None
    path = os.path.join(folder, _NAME)
    pause = 0.005
    while not os.path.exists(path):
        if alive is not None:
            gone = bool(select.select([alive], [], [], pause)[0])
        else:
            time.sleep(pause)
            gone = os.getppid() != parent
        if gone:
            # The worker is gone before it said anything.
            shutil.rmtree(folder, ignore_errors=True)
            os._exit(0)
        # Prompt at a job's start; a server that waits long (a worker
        # between jobs) checks less often.
        pause = min(pause * 1.1, 0.1)
    try:
        if not _trusted(folder):
            return
        with open(path) as f:
            word = json.load(f)
    except (OSError, ValueError):
        return
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for entry in reversed(word.get("sys_path", [])):
        if isinstance(entry, str) and entry not in sys.path:
            sys.path.insert(0, entry)
    for module in word.get("modules", []):
        try:
            __import__(module)
        except BaseException:  # noqa: BLE001 (each load process reports it)
            pass

