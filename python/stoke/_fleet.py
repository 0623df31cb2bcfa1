"""``torch_batch_process(..., workers=N)`` and ``coordinator=``: the job's
code shipped by value, and the job run by local worker processes or a
running fleet.

The processor class and the dataset (with its DataLoader arguments) are
pickled with ``cloudpickle``, as Ray and Dask ship user code, into one
object under the job's root (``code/<job>.pkl``); the spec names it
(``[processor] code``) and each worker loads it once per job. Classes
defined in the caller's ``__main__`` travel by value; so do those of
modules found outside the environment's installed packages (the user's
own files), so a fleet elsewhere need not have them.

Not a public module.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from typing import Any

from . import _native
from ._client import Client
from ._native_client import JobPaused, StokeError
from ._signals import stop_on_signals

_TERMINAL = {"succeeded", "failed", "cancelled"}


def new_job_id(cls: type) -> str:
    return f"py-{uuid.uuid4().hex[:12]}"


def _installed(module: Any) -> bool:
    """Whether a module comes with the environment (the standard library
    or an installed package), so a worker imports it by name."""
    path = getattr(module, "__file__", None)
    if path is None:
        return True
    path = os.path.realpath(path)
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(path.startswith(os.path.realpath(r) + os.sep) for r in roots)


def _user_modules(objects: list) -> list:
    """The user's own modules that hold the classes of ``objects``."""
    found = []
    for obj in objects:
        cls = obj if isinstance(obj, type) else type(obj)
        for klass in cls.__mro__:
            module = sys.modules.get(klass.__module__)
            if module is None or module.__name__ in ("__main__", "builtins") or module.__name__.startswith("stoke"):
                continue
            if not _installed(module) and module not in found:
                found.append(module)
    return found


def _unpicklable_part(obj: Any, dumps) -> str | None:
    """Names the attribute of ``obj`` that cannot be pickled, if one is."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return None
    for name, value in attrs.items():
        try:
            dumps(value)
        except Exception:
            return f"its attribute {name!r} ({type(value).__module__}.{type(value).__qualname__})"
    return None


def dumps_shipped(shipped: dict) -> bytes:
    """The job's code as one cloudpickled object, or a TypeError naming
    what cannot be pickled and the other way in."""
    import cloudpickle

    modules = _user_modules([v for v in shipped.values() if v is not None and not isinstance(v, dict)])
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        for key in ("processor", "dataset", "dataloader_kwargs"):
            if key not in shipped:
                continue
            obj = shipped[key]
            try:
                cloudpickle.dumps(obj)
            except Exception as e:
                what = {
                    "processor": f"the processor class {getattr(obj, '__qualname__', obj)!r}",
                    "dataset": f"the dataset ({type(obj).__qualname__})",
                    "dataloader_kwargs": "dataloader_kwargs",
                }[key]
                part = _unpicklable_part(obj, cloudpickle.dumps) if key != "processor" else None
                where = f": {part}" if part else ""
                raise TypeError(
                    f"{what} cannot be pickled to ship it to the workers{where}: {type(e).__name__}: {e}. "
                    "Open files, locks and connections do not pickle: open them in __getitem__ (or lazily), "
                    "or give the workers a factory that makes the dataset there: "
                    '[dataset] format = "python" with factory = "my_data:make_dataset" (and python_path) in a job spec'
                ) from None
        return cloudpickle.dumps(shipped, protocol=pickle.DEFAULT_PROTOCOL)
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def ship(shipped: dict, root: str, job_id: str) -> str:
    """Writes the job's code under ``root``; returns its URI."""
    data = dumps_shipped(shipped)
    target = root.rstrip("/") + f"/code/{job_id}.pkl"
    return _native.store_put(target, data)


def _report(client: Any, job_id: str) -> dict:
    info = client.status(job_id)
    report = {
        "job": info,
        "job_id": job_id,
        "records": info.get("records_total") or info.get("records_done"),
        "records_skipped": info.get("records_skipped", 0),
        "manifest_uri": info.get("manifest_uri"),
        "outputs": [],
    }
    if info["state"] != "succeeded":
        reason = info.get("reason") or "no reason recorded"
        raise StokeError(f"job {job_id} {info['state']}: {reason}")
    manifest = json.loads(_native.store_get(info["manifest_uri"]))
    report["records"] = manifest["records_in"]
    report["records_out"] = manifest.get("records_out")
    report["records_skipped"] = manifest.get("records_skipped", 0)
    report["outputs"] = [{"uri": o["uri"], "records": o["records"]} for o in manifest["outputs"]]
    # The metric reducers' results, stored before the job succeeded.
    report["metrics"] = client.report(job_id).get("metrics", {})
    return report


def _submit(client: Any, spec: dict, job_id: str) -> dict:
    job = client.submit(spec, job_id=job_id)
    if job["state"] == "paused":
        # The same call again resumes the job it paused.
        job = client.resume(job_id)
    return job


def run_on(coordinator: str, spec: dict, job_id: str) -> dict:
    """Submits to a running fleet and waits for the job to end."""
    client = Client(coordinator)
    _submit(client, spec, job_id)
    for info in client.watch(job_id, poll=0.2):
        pass
    return _report(client, job_id)


class _Workers:
    """N worker processes (``python -m stoke._worker``) against a local
    coordinator; one that dies while the job runs is replaced, as
    ``stoke run --local`` does."""

    def __init__(self, address: str, n: int, device: str, logs: str) -> None:
        self.address = address
        self.device = device
        self.logs = logs
        self.threads = max(1, (os.cpu_count() or 1) // n)
        self.restarts = 0
        self.n = n
        # The caller's sys.path, so modules it imports by name import there.
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        self.procs = [self._spawn(i) for i in range(n)]

    def _spawn(self, i: int) -> subprocess.Popen:
        log = open(os.path.join(self.logs, f"worker-local-{i}.log"), "ab")
        env = dict(self.env, STOKE_WORKER_RANK=str(i), STOKE_WORKER_COUNT=str(self.n))
        try:
            # A process group of its own: a Ctrl-C reaches this process
            # alone, which stops each worker with one SIGTERM; and what the
            # worker started goes with the group once it exits (_reap).
            return subprocess.Popen(
                [sys.executable, "-m", "stoke._worker", "--coordinator", self.address, "--worker-id", f"local-{i}",
                 "--device", self.device, "--threads", str(self.threads), "--exit-when-idle"],
                stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0)
        finally:
            log.close()

    def _reap(self, p: subprocess.Popen) -> None:
        """Kills what is left of an exited worker's process group (a fork
        server, load processes, DataLoader workers, an engine), once: the
        group's id is free for reuse after that."""
        if getattr(p, "_stoke_reaped", False):
            return
        p._stoke_reaped = True
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def supervise(self) -> bool:
        """Replaces workers that died; False once none is left."""
        alive = False
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is not None:
                self._reap(p)
            if code is None:
                alive = True
            elif code != 0:
                self.restarts += 1
                if self.restarts > 10 * len(self.procs):
                    raise StokeError(f"local workers keep dying (last exit {code}); see their logs in {self.logs}")
                self.procs[i] = self._spawn(i)
                alive = True
        return alive

    def stop(self, deadline: float = 60.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + deadline
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            self._reap(p)


def run_local(spec: dict, root: str, job_id: str, workers: int, device: str) -> dict:
    """Runs the job on ``workers`` local worker processes, as ``stoke run
    --local N``. SIGTERM or Ctrl-C: the workers checkpoint and stop, the
    job is paused, and :class:`JobPaused` is raised."""
    coordinator = _native.LocalCoordinator(root)
    fleet = None
    logs = tempfile.mkdtemp(prefix=f"stoke-{job_id}-")
    try:
        client = Client(coordinator.address)
        _submit(client, spec, job_id)
        with stop_on_signals(fifo=False):
            try:
                fleet = _Workers(coordinator.address, workers, device, logs)
                while True:
                    info = client.status(job_id)
                    if info["state"] in _TERMINAL:
                        break
                    if not fleet.supervise():
                        break
                    time.sleep(0.1)
            except KeyboardInterrupt:
                # Each worker checkpoints after its current batch and
                # releases its lease; then the job is paused.
                if fleet is not None:
                    fleet.stop()
                info = client.status(job_id)
                if info["state"] not in _TERMINAL:
                    info = client.pause(job_id)
                    raise JobPaused(
                        f"job {job_id} paused after its last checkpoint ({info['records_done']} of {info.get('records_total')} records committed): "
                        f"run the same call again with job id {job_id} and root {root} to resume it"
                    ) from None
        info = client.status(job_id)
        if info["state"] == "running" and fleet is not None:
            raise StokeError(f"job {job_id}: every local worker stopped before the job ended; see their logs in {logs}")
        report = _report(client, job_id)
        shutil.rmtree(logs, ignore_errors=True)
        return report
    finally:
        if fleet is not None:
            fleet.stop(deadline=10.0)
        coordinator.close()
