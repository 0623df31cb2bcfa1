"""A Python processor's ``load_fn`` (Graphbook's): called once per record
on load processes that run ahead of the model; the results
reach ``process_batch`` as ``batch.samples``, in record order.

The worker's prepare thread submits each batch here as soon as the
reader has cut it, the whole batch to one load process (as a DataLoader
worker loads a whole batch), with 64 records' worth of batches ahead of
the model per load process (at least a batch each, at least two), and on
into the next shard while this one's last batches are processed and
committed (one prepare thread for the job); ``process_batch`` waits for
that batch's results. When ``load_fn``
returns tensors of one shape and type, the load process stacks them into
shared memory: that is ``batch.collated``, and ``batch.samples`` are
views of it.
The load processes live for the job on that worker. They start from a
fork server run by the venv's Python (never a fork of the worker, which
is a multi-threaded process), and get ``load_fn`` by value
(cloudpickle), once each. The server imports ``load_fn``'s module before
it forks any of them, so what that module imports (torchvision, say: a
second of CPU) is imported once, not once per load process; a server
started ahead of its job waits for the module's name (``say_word``).

An exception in ``load_fn`` is that record's error (its traceback); a
load process that dies breaks their executor: a new one is started (once,
for all the batches that were in flight on the broken one) and their records
are tried again one at a time, so the record
that kills a process is the one that counts as an error, and nothing
waits forever.

Not a public module.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import sys
import threading
import traceback
from concurrent.futures.process import BrokenProcessPool
from typing import Any

_FN = None
_FORK_SERVER = None
# stoke._fork_server: the server leaves without finalising torch.
_PRELOAD = ["stoke._fork_server", "torch", "cloudpickle"]


def _context() -> Any:
    global _FORK_SERVER
    if _FORK_SERVER is None:
        multiprocessing.set_executable(sys.executable)
        _FORK_SERVER = multiprocessing.get_context("forkserver")
    return _FORK_SERVER


def fork_server(extra: list | None = None) -> Any:
    """The ``forkserver`` context for this process's load processes and
    DataLoader workers. The server runs the venv's Python (in a worker's
    embedded interpreter ``sys.executable`` is set to it) with torch
    imported, so each process forks from a clean, single-threaded process
    that has torch already (never from the worker, which is a
    multi-threaded process). ``extra``: modules the server imports too:
    in its preload when it is not running yet, else by the word a server
    started ahead waits for (``say_word``)."""
    wanted = [m for m in extra or [] if m not in _PRELOAD]
    context = _context()
    context.set_forkserver_preload(_PRELOAD + wanted)
    # Before any process is asked of a server that waits for the word.
    say_word(wanted)
    return context


# The folder where a fork server started ahead of its job waits for its
# word (see start_fork_server); None once said, or when none waits.
_WORD = None
_WORD_LOCK = threading.Lock()
# Imported last by a server started ahead: it waits for the word there.
_WAIT_FOR_WORD = "stoke._fork_wait"


def start_fork_server(extra: list | None = None) -> Any:
    """Starts the fork server now and returns its pid (``None`` where
    Python does not say). A worker started for a job with load processes
    (``stoke-worker --python-prewarm-loading``) calls it before its own
    ``import torch``, so the server's import runs beside the worker's
    instead of after it. The job, and so ``load_fn``'s module, is not
    known yet: once torch is imported the server waits, before it forks
    anything, for the word of what else to import (``say_word``)."""
    global _WORD
    from multiprocessing import forkserver

    from . import _fork_word

    context = _context()
    with _WORD_LOCK:
        running = getattr(forkserver._forkserver, "_forkserver_pid", None) is not None
        folder = None if running else _fork_word.make_folder()
        wait = [_WAIT_FOR_WORD, _fork_word.preload_entry(os.getpid())] if folder else []
        context.set_forkserver_preload(_PRELOAD + [m for m in extra or [] if m not in _PRELOAD] + wait)
        forkserver.ensure_running()
        _WORD = folder
        # A server started again (after one died) does not wait.
        context.set_forkserver_preload(_PRELOAD)
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def say_word(modules: list) -> None:
    """Tells a fork server started ahead, if one waits, what to import
    before it forks anything (``modules``, with this process's
    ``sys.path``); it goes on serving once it has. Said once: later calls
    do nothing, and a module not importable there is imported (and its
    error raised) in each load process as before."""
    global _WORD
    with _WORD_LOCK:
        folder, _WORD = _WORD, None
    if folder is None:
        return
    from . import _fork_word

    word = {"sys_path": list(sys.path), "modules": [m for m in modules if m and m != "__main__"]}
    _fork_word.write(folder, json.dumps(word))


def preload_module(module: str) -> None:
    """A worker about to import the processor's ``module`` for a job with
    load processes: a server started ahead imports it too, at the same
    time (``load_fn`` is usually defined there, with what it imports)."""
    say_word([module])


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
    back as one stacked tensor (one shared-memory transfer for the batch,
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
    """One batch's records in flight: the whole batch on one load process
    (``future``), the executor it was submitted to (``executor``: when a
    load process dies, only that executor is replaced, once, however many
    of the batches in flight on it fail), and the ``LoadProcesses`` that
    took it
    (``owner``: a batch submitted ahead by a processor since replaced is
    loaded again by the new one)."""

    def __init__(self, items: list, future: Any = None, executor: Any = None, owner: Any = None) -> None:
        self.items = items
        self.future = future
        self.executor = executor
        self.owner = owner


class LoadProcesses:
    """A job's load processes on this worker (``[loading] workers`` of
    them), which run ``load_fn`` ahead of the model."""

    def __init__(self, fn: Any, workers: int) -> None:
        self.fn = fn
        self.workers = workers
        self._executor = None
        self._data = None
        # Closed with its processor: a batch submitted later (the prepare
        # thread may still hand one over) starts no processes.
        self._closed = False
        # The prepare thread submits while the processor's thread waits
        # for results (and may replace a broken executor): one at a time.
        self._lock = threading.Lock()

    def start(self) -> None:
        """Starts the load processes now (the processor is being made),
        so they are ready when the first batch comes."""
        executor = self._running() if self.workers > 0 else None
        if executor is None:
            return
        for _ in range(self.workers):
            executor.submit(_ready)

    def _running(self) -> concurrent.futures.ProcessPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._executor is None:
                import cloudpickle

                if self._data is None:
                    self._data = cloudpickle.dumps(self.fn)
                # load_fn's own module too, when it is importable by name
                # and the server is not running yet (with what it imports).
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
        return self._submit_items(items)

    def _submit_items(self, items: list) -> Pending:
        executor = self._running() if self.workers > 0 else None
        if executor is None:
            # No load processes (or closed): loaded when asked for.
            return Pending(items, owner=self)
        # The whole batch on one load process, as a DataLoader worker
        # loads a whole batch: it comes back stacked in shared memory
        # (``batch.collated``), with nothing to stack again here. The
        # batches queued ahead (see the worker's look-ahead) keep every
        # process busy.
        try:
            future = executor.submit(_load_chunk, items)
        except BrokenProcessPool:
            self._replace(executor)
            executor = self._running()
            if executor is None:
                return Pending(items, owner=self)
            future = executor.submit(_load_chunk, items)
        return Pending(items, future, executor, self)

    def _replace(self, broken: Any) -> None:
        """Drops ``broken`` (an executor a load process died in), unless
        it was replaced already: a new executor is never shut down for an
        old one."""
        with self._lock:
            if self._executor is not broken:
                return
            self._executor = None
        broken.shutdown(wait=False, cancel_futures=True)

    def results(self, pending: Pending) -> tuple:
        """``(results, collated)``: ``(True, sample)`` or ``(False,
        error)`` per record, in order; and the samples stacked in shared
        memory by the load process when they are tensors of one shape and
        type (else ``None``)."""
        if pending.owner is not self:
            # Submitted ahead to the load processes of a processor since
            # replaced.
            pending = self._submit_items(pending.items)
        if pending.future is None:
            return _load_here(self.fn, pending.items), None
        try:
            result = pending.future.result()
        except BrokenProcessPool:
            # A load process died (this batch's or another's on the same
            # executor): a fresh executor, and each record of the batch tried on
            # its own, so the one that kills a process is the one that
            # counts as an error.
            self._replace(pending.executor)
            return [self._alone(item) for item in pending.items], None
        if isinstance(result, _Stacked):
            return result.unpack(), result.tensor
        return result, None

    def _alone(self, item: Any) -> tuple:
        executor = self._running()
        if executor is None:
            return _load_here(self.fn, [item])[0]
        try:
            return _unpack(executor.submit(_load_chunk, [item]).result())[0]
        except BrokenProcessPool:
            self._replace(executor)
            return (False, "the load process running load_fn on this record died (killed, or crashed in native code)")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
