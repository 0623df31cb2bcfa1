"""A map-style torch ``Dataset`` as a stoke source: its records are its
indices, a shard is a range of them, and a shard's batches are what
``torch.utils.data.DataLoader(Subset(dataset, indices), batch_size=...,
shuffle=False, **dataloader_kwargs)`` yields. The worker's pipeline cuts
the same batches of indices (and commits them); this module turns each
into the DataLoader's batch, keeping one DataLoader iterator alive while
the batches asked for follow each other, so its workers and prefetching
run ahead as they would in a plain loop. What it prefetched but was not
processed is never committed: the commit counts the worker's batches.

Not a public module.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _host, _loading

# DataLoader arguments the shards own: refused, as Determined refuses them.
_REFUSED = {
    "shuffle": "the shards own the order (every index once, in order); shuffle=True is refused",
    "sampler": "the shards own the order and the indices; a sampler is refused",
    "batch_sampler": "the shards cut the batches; a batch_sampler is refused",
}

# Arguments that start DataLoader worker processes: a one-off batch (a
# record left out) is loaded in this process instead.
_WORKER_ARGS = ("num_workers", "prefetch_factor", "persistent_workers", "worker_init_fn", "multiprocessing_context", "timeout")



class DatasetError(Exception):
    """A dataset or its DataLoader arguments that stoke cannot take."""


def check_dataloader_kwargs(dataloader_kwargs: Any, batch_size: Any) -> tuple[dict, int]:
    """The DataLoader arguments to use and the batch size, or a
    `DatasetError` naming what is refused."""
    kwargs = dict(dataloader_kwargs or {})
    for key, why in _REFUSED.items():
        value = kwargs.get(key)
        if key == "shuffle":
            if value:
                raise DatasetError(f"dataloader_kwargs: shuffle=True: {why}")
            kwargs.pop(key, None)
        elif value is not None:
            raise DatasetError(f"dataloader_kwargs: {key}={value!r}: {why}")
        else:
            kwargs.pop(key, None)
    if kwargs.get("drop_last"):
        raise DatasetError("dataloader_kwargs: drop_last=True: every index is processed exactly once; drop_last is refused")
    kwargs.pop("drop_last", None)
    if "batch_size" in kwargs:
        if batch_size is not None:
            raise DatasetError(
                f"batch_size given twice: as the argument ({batch_size!r}) and in dataloader_kwargs ({kwargs['batch_size']!r}); give it once"
            )
        batch_size = kwargs.pop("batch_size")
    if batch_size is None:
        batch_size = 1
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise DatasetError(f"batch_size must be a positive int, got {batch_size!r}")
    return kwargs, batch_size


def check_map_style(dataset: Any) -> int:
    """``len(dataset)``, or a `DatasetError` for what is not a map-style
    Dataset."""
    try:
        from torch.utils.data import IterableDataset
    except ImportError:  # pragma: no cover - torch is a requirement
        IterableDataset = ()
    if isinstance(dataset, IterableDataset):
        raise DatasetError(
            f"{type(dataset).__name__} is an IterableDataset: stoke shards a map-style Dataset by its indices (define __len__ and __getitem__)"
        )
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise DatasetError(
            f"{type(dataset).__name__} is not a map-style Dataset (it needs __len__ and __getitem__), nor a spec path or dict"
        )
    n = len(dataset)
    if n < 1:
        raise DatasetError(f"the dataset ({type(dataset).__name__}) is empty: len() is {n}")
    return n


class _ListBatch(list):
    """A DataLoader batch that was a list (``batch[0]`` as in a plain
    loop), with the records' ids (``batch.ids``: the indices, as
    strings). Pickles (``torch.save``) as a plain list."""

    ids: list

    def __reduce__(self):
        return (list, (list(self),))


class _DictBatch(dict):
    """A DataLoader batch that was a dict, with ``ids`` as for lists."""

    ids: list

    def __reduce__(self):
        return (dict, (dict(self),))


def _with_ids(data: Any, ids: list) -> Any:
    if type(data) is list:
        out = _ListBatch(data)
    elif type(data) is dict:
        out = _DictBatch(data)
    else:
        return data
    out.ids = ids
    return out


def _batch_len(data: Any) -> int | None:
    """How many samples a collated batch holds, when it says."""
    import torch

    if isinstance(data, torch.Tensor):
        return data.shape[0] if data.dim() > 0 else None
    if isinstance(data, (list, tuple)) and data:
        return _batch_len(data[0])
    if isinstance(data, dict) and data:
        return _batch_len(next(iter(data.values())))
    return None


class _ByValue:
    """Ships an object to DataLoader worker processes with cloudpickle,
    so a dataset (or collate_fn) whose class was itself shipped by value
    (defined in the caller's ``__main__``) loads there too."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __reduce__(self):
        import cloudpickle

        return (_loads, (cloudpickle.dumps(self.obj),))


def _loads(data: bytes) -> Any:
    import cloudpickle

    return cloudpickle.loads(data)


class _ShippedDataset:
    """The dataset as DataLoader workers get it (see `_ByValue`)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __reduce__(self):
        return (_ShippedDataset, (_ByValue(self.dataset),))


def _unwrap(obj: Any) -> Any:
    return obj.obj if isinstance(obj, _ByValue) else obj


_SHIPPED_CALLABLES = ("collate_fn", "worker_init_fn")


class DatasetFeed:
    """The DataLoader batches of one dataset, asked for by their indices."""

    def __init__(self, dataset: Any, dataloader_kwargs: dict, batch_size: int, count: int, in_worker: bool) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.count = count
        self.kwargs = dict(dataloader_kwargs)
        # `_host.IN_WORKER`: set in a worker process started as `python -m
        # stoke._worker` (an embedded interpreter in a worker binary says so
        # when it opens a feed).
        self._in_worker = in_worker or _host.IN_WORKER
        self._it = None
        self._next = None  # the first index of the batch `_it` yields next

    def _loader(self, indices: Any, batch_size: int, with_workers: bool):
        import torch.utils.data as tud

        kwargs = dict(self.kwargs)
        if not with_workers:
            for key in _WORKER_ARGS:
                kwargs.pop(key, None)
        dataset = self.dataset
        if kwargs.get("num_workers", 0) > 0 and "multiprocessing_context" not in kwargs and self._in_worker:
            # In a stoke worker the process is multi-threaded Rust (fork is
            # unsafe there) and its interpreter is embedded: start the
            # DataLoader's processes from a fork server run by the venv's
            # Python, and ship the dataset and callables by value.
            kwargs["multiprocessing_context"] = _loading.fork_server()
            dataset = _ShippedDataset(dataset)
            for key in _SHIPPED_CALLABLES:
                if kwargs.get(key) is not None:
                    kwargs[key] = _ShippedCall(kwargs[key])
        return tud.DataLoader(tud.Subset(dataset, indices), batch_size=batch_size, shuffle=False, **kwargs)

    def batch(self, indices: list) -> Any:
        n = len(indices)
        first = indices[0]
        contiguous = indices[-1] - first + 1 == n and all(b - a == 1 for a, b in zip(indices, indices[1:]))
        whole = contiguous and n == min(self.batch_size, self.count - first)
        if whole and self._it is not None and first == self._next:
            data = next(self._it)
        elif whole:
            # A new run of batches (a new shard, a resume): one iterator
            # over the indices from here on, kept while batches follow.
            self.close()
            loader = self._loader(range(first, self.count), self.batch_size, with_workers=True)
            self._it = iter(loader)
            data = next(self._it)
        else:
            # Part of a batch (a record left out): loaded on its own.
            data = next(iter(self._loader(list(indices), n, with_workers=False)))
            got = _batch_len(data)
            if got is not None and got != n:
                raise DatasetError(f"the DataLoader gave {got} samples for {n} indices {indices[:8]}...")
            return _with_ids(data, [str(i) for i in indices])
        self._next = first + n
        got = _batch_len(data)
        if got is not None and got != n:
            self.close()
            raise DatasetError(
                f"the DataLoader gave a batch of {got} samples where indices {first}..{first + n - 1} ({n}) were expected "
                "(does collate_fn drop or add samples?)"
            )
        return _with_ids(data, [str(i) for i in indices])

    def close(self) -> None:
        it, self._it, self._next = self._it, None, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class _ShippedCall:
    """A callable (collate_fn, worker_init_fn) shipped by value."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __reduce__(self):
        return (_ShippedCall, (_ByValue(self.fn),))


# Datasets handed to stoke.torch_batch_process in this process, by the
# name the job spec gives them (`__stoke_local__:D<n>`), with their
# DataLoader arguments.
_LOCAL: dict[str, tuple] = {}


def register_local(module: str, dataset: Any, dataloader_kwargs: dict) -> str:
    for key, (known, kwargs) in _LOCAL.items():
        if known is dataset and kwargs == dataloader_kwargs:
            return f"{module}:{key}"
    key = f"D{len(_LOCAL)}"
    _LOCAL[key] = (dataset, dict(dataloader_kwargs))
    return f"{module}:{key}"


def resolve(factory: str, local_module: str, shipped: Any) -> tuple:
    """``(dataset, dataloader_kwargs)`` for the spec's ``factory``."""
    module, _, name = factory.partition(":")
    if module == local_module:
        found = _LOCAL.get(name)
        if found is None:
            raise DatasetError(f"no dataset registered as {factory} in this process")
        return found
    if shipped is not None:
        return shipped
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise DatasetError(f"dataset factory {factory}: cannot import {module!r}: {e} (set [dataset] python_path?)") from e
    fn: Any = mod
    for part in name.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise DatasetError(f"dataset factory {factory}: module {module!r} ({getattr(mod, '__file__', '?')}) has no {name!r}")
    if not callable(fn):
        raise DatasetError(f"dataset factory {factory} is a {type(fn).__name__}, not a callable")
    return fn(), {}


def open_feed(factory: str, local_module: str, batch_size: int, count: int, in_worker: bool, shipped: Any = None) -> DatasetFeed:
    dataset, kwargs = resolve(factory, local_module, shipped)
    n = check_map_style(dataset)
    if n < count:
        raise DatasetError(
            f"the dataset from {factory} has {n} records, but the job was planned for {count}: it changed since the job was submitted"
        )
    return DatasetFeed(dataset, kwargs, batch_size, count, in_worker)
