"""Runs a command under a subreaper and reports the processes it left.

    python reap.py REPORT.json [--grace SECONDS] -- COMMAND [ARG...]

This process becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``): a
process the command started whose parent dies is re-parented here, not
to PID 1, so the processes whose parent chain leads here are exactly
those the run started, and stay so after their parents die. SIGTERM and
SIGINT are passed on to the command (as a terminal's Ctrl-C reaches the
program in the foreground). Once the command has exited, this waits up
to ``--grace`` seconds for the rest to exit (reaping them), then writes
``{"exit": status, "left": [{"pid", "ppid", "cmdline"}...]}`` to
REPORT.json, kills whatever is left (so that a failing test leaves
nothing either) and exits with the command's status. Linux only.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def _stat(pid: int):
    """(state, ppid) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[0], int(fields[1])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(p.decode(errors="replace") for p in f.read().split(b"\0") if p)
    except OSError:
        return ""


def descendants(root: int) -> list:
    """Living (not zombie) processes whose parent chain leads to ``root``."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                parents[int(name)] = stat
    out = []
    for pid, (state, _) in parents.items():
        if state == "Z":
            continue
        seen, at = set(), pid
        while at in parents and at not in seen and at != root:
            seen.add(at)
            at = parents[at][1]
        if at == root and pid != root:
            out.append(pid)
    return sorted(out)


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> int:
    args = sys.argv[1:]
    report = args.pop(0)
    grace = 10.0
    if args and args[0] == "--grace":
        grace = float(args[1])
        args = args[2:]
    if args and args[0] == "--":
        args = args[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    child = subprocess.Popen(args)

    def forward(sig, _frame):
        try:
            child.send_signal(sig)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = child.wait()
    me = os.getpid()
    deadline = time.monotonic() + grace
    while True:
        _reap_zombies()
        left = descendants(me)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    listed = []
    for pid in left:
        stat = _stat(pid)
        listed.append({"pid": pid, "ppid": stat[1] if stat else None, "cmdline": _cmdline(pid)})
    with open(report, "w") as f:
        json.dump({"exit": status, "left": listed}, f)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while descendants(me) and time.monotonic() < deadline:
        _reap_zombies()
        time.sleep(0.05)
    _reap_zombies()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
