"""A Python processor's ``load_fn`` (Graphbook's): called once per record
on a pool of load processes that runs ahead of the model; the results
reach ``process_batch`` as ``batch.samples``, in record order.

The worker's prepare thread submits each batch's records here as soon as
the reader has cut the batch (at most two batches ahead of the model, as
the Rust load stage); ``process_batch`` waits for that batch's results.
The pool lives for the job on that worker. Its processes start from a
fork server run by the venv's Python (never a fork of the worker, which
is a multi-threaded process), and get ``load_fn`` by value
(cloudpickle), once each.

An exception in ``load_fn`` is that record's error (its traceback); a
load process that dies breaks the pool: a new pool is started and the
records that were in flight are tried again one at a time, so the record
that kills a process is the one that counts as an error, and nothing
waits forever.

Not a public module.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import sys
import traceback
from concurrent.futures.process import BrokenProcessPool
from typing import Any

_FN = None
_FORK_SERVER = None
# stoke._fork_server: the server leaves without finalising torch.
_PRELOAD = ["stoke._fork_server", "torch", "cloudpickle"]


def fork_server(extra: list | None = None) -> Any:
    """The ``forkserver`` context for this process's load processes and
    DataLoader workers. The server runs the venv's Python (in a worker's
    embedded interpreter ``sys.executable`` is set to it) with torch
    imported, so each process forks from a clean, single-threaded process
    that has torch already (never from the worker, which is a
    multi-threaded process). ``extra``: modules the server imports too,
    when it is not running yet."""
    global _FORK_SERVER
    if _FORK_SERVER is None:
        multiprocessing.set_executable(sys.executable)
        _FORK_SERVER = multiprocessing.get_context("forkserver")
    _FORK_SERVER.set_forkserver_preload(_PRELOAD + [m for m in extra or [] if m not in _PRELOAD])
    return _FORK_SERVER


def start_fork_server(extra: list | None = None) -> Any:
    """Starts the fork server now and returns its pid (``None`` where
    Python does not say). A worker started for a job with load processes
    (``stoke-worker --python-prewarm-loading``) calls it before its own
    ``import torch``, so the server's import runs beside the worker's
    instead of after it."""
    from multiprocessing import forkserver

    fork_server(extra)
    forkserver.ensure_running()
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _init(data: bytes) -> None:
    global _FN
    import cloudpickle
    import torch

    # One intra-op thread per load process, as in a DataLoader worker:
    # the processes are the parallelism.
    torch.set_num_threads(1)
    _FN = cloudpickle.loads(data)


def _load_chunk(items: list) -> Any:
    """In a load process: ``(True, sample)`` or ``(False, traceback)`` per
    item; when every sample is a tensor of one shape and type, they travel
    back as one stacked tensor (one shared-memory transfer for the chunk,
    not one per record, as a DataLoader worker collates its batch)."""
    out = []
    for item in items:
        try:
            out.append((True, _FN(_with_bytes(item))))
        except BaseException:
            out.append((False, traceback.format_exc().rstrip()))
    return _pack(out)


class _LocalFile:
    """A ``files`` record's item whose ``bytes`` the load process reads
    from the local file itself (the worker passes its path instead of the
    bytes: they need not cross a pipe)."""

    __slots__ = ("item", "path")

    def __init__(self, item: dict, path: str) -> None:
        self.item = item
        self.path = path


def _with_bytes(item: Any) -> dict:
    if isinstance(item, _LocalFile):
        with open(item.path, "rb") as f:
            return {**item.item, "bytes": f.read()}
    return item


def _pack(out: list) -> Any:
    import torch

    first = out[0][1] if out and out[0][0] else None
    if (
        isinstance(first, torch.Tensor)
        and all(ok and isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype for ok, v in out)
    ):
        if first.device.type != "cpu":
            return _Stacked(torch.stack([v for _, v in out]))
        # Stacked straight into shared memory, as a DataLoader worker
        # collates (torch.utils.data's default_collate does it this way):
        # the chunk then crosses to the worker without another copy.
        storage = first._typed_storage()._new_shared(first.numel() * len(out), device=first.device)
        stacked = first.new(storage).resize_(len(out), *first.shape)
        torch.stack([v for _, v in out], out=stacked)
        return _Stacked(stacked)
    return out


class _Stacked:
    """A chunk's samples stacked into one tensor."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def unpack(self) -> list:
        return [(True, t) for t in self.tensor.unbind(0)]


def _unpack(result: Any) -> list:
    return result.unpack() if isinstance(result, _Stacked) else result


def _ready() -> None:
    return None


def _load_here(fn: Any, items: list) -> list:
    out = []
    for item in items:
        try:
            out.append((True, fn(_with_bytes(item))))
        except Exception:
            out.append((False, traceback.format_exc().rstrip()))
    return out


def load_fn_of(instance: Any) -> Any:
    """The processor's ``load_fn``, when its class defines one."""
    fn = getattr(type(instance), "load_fn", None)
    return fn if callable(fn) else None


class Pending:
    """One batch's records in flight."""

    def __init__(self, items: list, chunks: list) -> None:
        self.items = items
        self.chunks = chunks  # (start, future) per chunk, in order


class LoadPool:
    def __init__(self, fn: Any, workers: int) -> None:
        self.fn = fn
        self.workers = workers
        self._executor = None
        self._data = None

    def start(self) -> None:
        """Starts the load processes now (the processor is being made),
        so they are ready when the first batch comes."""
        if self.workers == 0:
            return
        pool = self._pool()
        for _ in range(self.workers):
            pool.submit(_ready)

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._executor is None:
            import cloudpickle

            if self._data is None:
                self._data = cloudpickle.dumps(self.fn)
            # load_fn's own module too, when it is importable by name and
            # the server is not running yet (with what it imports).
            module = getattr(self.fn, "__module__", None)
            extra = [module] if module and module != "__main__" and module in sys.modules else []
            ctx = fork_server(extra)
            self._executor = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.workers, mp_context=ctx, initializer=_init, initargs=(self._data,))
        return self._executor

    def submit(self, columns: dict, n: int, paths: list | None = None) -> Pending:
        """``paths``: a local ``files`` batch's files, whose ``bytes`` are
        not in ``columns``: each item's is read where ``load_fn`` runs."""
        names = list(columns)
        items = [{name: columns[name][i] for name in names} for i in range(n)]
        if paths is not None:
            items = [_LocalFile(item, path) for item, path in zip(items, paths)]
        if self.workers == 0:
            return Pending(items, [])
        # One chunk per process: each process gets work, the results come
        # back in order, and a batch costs one call and one transfer per
        # process (the batches queued ahead keep every process busy).
        size = max(1, -(-n // self.workers))
        chunks = []
        for start in range(0, n, size):
            chunks.append((start, self._submit(items[start:start + size])))
        return Pending(items, chunks)

    def _submit(self, items: list) -> Any:
        try:
            return self._pool().submit(_load_chunk, items)
        except BrokenProcessPool:
            self._restart()
            return self._pool().submit(_load_chunk, items)

    def _restart(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def results(self, pending: Pending) -> list:
        """``(True, sample)`` or ``(False, error)`` per record, in order."""
        if self.workers == 0:
            return _load_here(self.fn, pending.items)
        out: list = []
        broken: list = []
        for start, future in pending.chunks:
            try:
                out.extend(_unpack(future.result()))
            except BrokenProcessPool:
                count = min(len(pending.items) - start, _chunk_len(pending, start))
                broken.append((len(out), start, count))
                out.extend([None] * count)
        if broken:
            # A load process died: a fresh pool, and each record that was
            # in flight tried on its own, so the one that kills a process
            # is the one that counts as an error.
            self._restart()
            for at, start, count in broken:
                for k in range(count):
                    out[at + k] = self._alone(pending.items[start + k])
        return out

    def _alone(self, item: Any) -> tuple:
        try:
            return _unpack(self._pool().submit(_load_chunk, [item]).result())[0]
        except BrokenProcessPool:
            self._restart()
            return (False, "the load process running load_fn on this record died (killed, or crashed in native code)")

    def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


def _chunk_len(pending: Pending, start: int) -> int:
    starts = [s for s, _ in pending.chunks]
    i = starts.index(start)
    end = starts[i + 1] if i + 1 < len(starts) else len(pending.items)
    return end - start
