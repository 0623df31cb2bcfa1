"""Runs one command and measures it: wall time of the whole command, and peak
memory, both of the process tree (sampled from /proc every 100 ms: the sum
of VmRSS over the command and every process it started, Ray's daemons and
stoke's worker processes included; shared library pages count once per
process) and of its largest single process (exact, from wait4's rusage).

    python bench/measure.py --json OUT.json --stdout OUT.log --stderr ERR.log -- CMD ARGS...

Writes {"rc", "wall_s", "peak_tree_rss_mib", "peak_proc_rss_mib"} to OUT.json
and exits with the command's status. Standard library only.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")
SAMPLE_S = 0.1


def proc_table():
    """(pid, ppid, session) of every process."""
    rows = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces: split after its closing paren.
        fields = stat.rsplit(")", 1)[-1].split()
        rows.append((int(name), int(fields[1]), int(fields[3])))
    return rows


def rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(root):
    """RSS summed over `root`, its descendants and its session (daemons that
    were re-parented to init keep the session)."""
    table = proc_table()
    children = {}
    for pid, ppid, _ in table:
        children.setdefault(ppid, []).append(pid)
    members = {pid for pid, _, sid in table if sid == root}
    stack = [root]
    seen = set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        stack.extend(children.get(pid, []))
    members |= seen
    return sum(rss_bytes(pid) for pid in members)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--stdout", required=True)
    parser.add_argument("--stderr", required=True)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        parser.error("no command given")
    peak_tree = 0
    with open(args.stdout, "wb") as out, open(args.stderr, "wb") as err:
        started = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
        # A thread waits for the exit, so the wall time is exact; the loop
        # samples memory every SAMPLE_S meanwhile. (Checking for the exit
        # only between samples rounded every wall time up to the next
        # sample: runs of 1.33 s and 1.34 s read 1.33 and 1.43.)
        ended = {}
        done = threading.Event()

        def wait_exit():
            ended["exit"] = os.wait4(child.pid, 0)
            ended["wall"] = time.perf_counter() - started
            done.set()

        threading.Thread(target=wait_exit, daemon=True).start()
        while not done.is_set():
            peak_tree = max(peak_tree, tree_rss(child.pid))
            done.wait(SAMPLE_S)
        _, status, usage = ended["exit"]
        wall = ended["wall"]
    # Anything the command left running in its session (a daemon that
    # outlived it) is stopped so the next run starts clean.
    for pid, _, sid in proc_table():
        if sid == child.pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    rc = os.waitstatus_to_exitcode(status)
    peak_proc = usage.ru_maxrss * 1024
    result = {
        "rc": rc,
        "wall_s": round(wall, 4),
        "peak_tree_rss_mib": round(max(peak_tree, peak_proc) / 2**20, 1),
        "peak_proc_rss_mib": round(peak_proc / 2**20, 1),
    }
    with open(args.json, "w") as f:
        json.dump(result, f)
    sys.exit(rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    main()
