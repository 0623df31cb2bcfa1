"""What a worker calls into: the context and batch a processor sees.

The worker (Rust, embedding CPython) hands in a native handle with the
job's facts and sinks; everything a processor touches is defined here.
Not a public module: use ``context`` and ``batch`` as handed to you.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import pathlib
import traceback
from collections.abc import Mapping
from typing import Any, Iterator

from . import _dataset, _loading, _reducer
from .processor import BadRecord, TorchBatchProcessor

# The worker checks this: a package of another protocol is refused with a
# message saying which versions differ.
PROTOCOL = 1


class Batch(Mapping):
    """One batch: column name -> values. Numeric columns, and numeric
    list columns whose lists have one length within the batch, are
    ``torch.Tensor`` on CPU (``[B]`` or ``[B, N]``, their Arrow type's
    dtype); ragged numeric lists are a list of 1-D tensors (``padded()``
    pads them); strings, binary and other columns are Python lists. ``batch[0]``, ``batch[1]``... give the columns in order, like the
    tuple a DataLoader yields."""

    __slots__ = ("_columns", "_names", "ids", "samples", "_collated", "_native_ptrs")

    def __init__(self, columns: dict, ids: list, native_ptrs: dict | None = None, samples: list | None = None,
                 collated: Any = None) -> None:
        self._columns = columns
        self._names = list(columns)
        #: The records' ids, as strings (the dataset's id column, or
        #: ``<shard>:<offset>``).
        self.ids = ids
        #: What the processor's ``load_fn`` returned for each record, in
        #: record order (``None`` when it defines no ``load_fn``).
        self.samples = samples
        self._collated = collated
        self._native_ptrs = native_ptrs or {}

    @property
    def collated(self) -> Any:
        """``samples`` as one batch, as a DataLoader's ``default_collate``
        makes it: tensors of one shape are stacked into ``[B, ...]``,
        dicts and tuples collated field by field. When a load process
        loaded the whole batch and every sample is a tensor of one shape
        and type, this is the tensor it stacked them into, in shared
        memory, with no copy (``samples`` are views of it): the fastest
        way to the model. Otherwise it is collated on first use."""
        if self._collated is None:
            if self.samples is None:
                raise AttributeError("batch.collated: the processor defines no load_fn, so the batch has no samples")
            from torch.utils.data import default_collate

            self._collated = default_collate(self.samples)
        return self._collated

    @property
    def columns(self) -> list:
        """Column names, in the dataset's order."""
        return list(self._names)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int) and not isinstance(key, bool):
            try:
                return self._columns[self._names[key]]
            except IndexError:
                raise IndexError(f"batch has {len(self._names)} columns ({', '.join(self._names)}), no column {key}") from None
        try:
            return self._columns[key]
        except KeyError:
            raise KeyError(f"no column {key!r} (columns: {', '.join(self._names)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        # The number of records (not of columns), as for a DataLoader batch.
        return len(self.ids)

    def padded(self, column: Any, value: float = 0.0) -> tuple:
        """A list column padded to its longest row: ``(tensor [B, L],
        lengths [B])``, the tensor of the column's type with ``value``
        after each row's end (dpipe's ``combine_pad``; the Rust batch's
        ``padded``)."""
        import torch

        data = self[column]
        if isinstance(data, torch.Tensor):
            if data.dim() != 2:
                raise ValueError(f"column {column!r} is a {data.dim()}-D tensor; padded() takes a list column")
            return data, torch.full((data.shape[0],), data.shape[1], dtype=torch.int64)
        rows = [r if isinstance(r, torch.Tensor) else torch.as_tensor(r) for r in data]
        if not rows:
            return torch.zeros((0, 0)), torch.zeros((0,), dtype=torch.int64)
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value), lengths

    def keys(self):  # noqa: D401 - Mapping's, kept explicit for the len() twist
        return self._columns.keys()

    def __repr__(self) -> str:
        return f"<stoke.Batch {len(self.ids)} records, columns {self._names}>"

    def __reduce__(self):
        # torch.save / pickle: a plain dict of the columns plus the ids, so
        # a saved batch loads without stoke.
        data = dict(self._columns)
        data.setdefault("ids", self.ids)
        return (dict, (data,))


def _to_arrow(rows: Any):
    import pyarrow as pa

    if isinstance(rows, pa.RecordBatch):
        return pa.Table.from_batches([rows])
    if isinstance(rows, pa.Table):
        return rows
    if not isinstance(rows, Mapping):
        raise TypeError(f"write_rows takes a dict of columns or a pyarrow Table, not {type(rows).__name__}")
    arrays = {}
    for name, value in rows.items():
        arrays[str(name)] = _column(str(name), value, pa)
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"write_rows: columns of different lengths: {lengths}")
    return pa.table(arrays)


def _column(name: str, value: Any, pa: Any):
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a requirement
        torch = None
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dim() == 0 or t.dim() > 2:
            raise ValueError(f"output column {name!r}: a tensor must be 1-D [B] or 2-D [B, N], got shape {list(t.shape)}")
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        arr = t.contiguous().numpy()
        if arr.ndim == 2:
            width = arr.shape[1]
            return pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1)), width)
        return pa.array(arr)
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        return value
    try:
        import numpy as np

        if isinstance(value, np.ndarray):
            if value.ndim == 2:
                return pa.FixedSizeListArray.from_arrays(pa.array(value.reshape(-1)), value.shape[1])
            if value.ndim != 1:
                raise ValueError(f"output column {name!r}: an array must be 1-D or 2-D, got shape {list(value.shape)}")
            return pa.array(value)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, (list, tuple)):
        return pa.array(list(value))
    raise TypeError(
        f"output column {name!r}: {type(value).__name__} is not a column; use a list, a numpy array, a 1-D or 2-D tensor, or a pyarrow array"
    )


class Fetched(bytes):
    """The bytes of a fetched object, also readable as a file (``read``,
    ``readline``, iteration by line, ``seek``, ``tell``), so
    ``torch.load(context.fetch(uri))``, ``torch.jit.load(...)``, ``io``-style
    readers and every ``bytes`` use (``json.loads``, ``hashlib``,
    ``np.frombuffer``, slicing, ``decode``) all work on it."""

    def __new__(cls, data: bytes) -> "Fetched":
        obj = super().__new__(cls, data)
        obj._pos = 0
        _let_torch_load_read_fetched()
        return obj

    def readline(self, size: int = -1) -> bytes:
        end = self.find(b"\n", self._pos)
        end = len(self) if end < 0 else end + 1
        if size is not None and size >= 0:
            end = min(end, self._pos + size)
        out = bytes(self[self._pos:end])
        self._pos = end
        return out

    def readlines(self) -> list:
        return list(iter(self.readline, b""))

    def __iter__(self):
        # As a file: by line (``for line in context.fetch(vocab_uri)``).
        return iter(self.readline, b"")

    def close(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False

    def __enter__(self) -> "Fetched":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def read(self, n: int = -1) -> bytes:
        end = len(self) if n is None or n < 0 else min(len(self), self._pos + n)
        out = bytes(self[self._pos:end])
        self._pos = end
        return out

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def _let_torch_load_read_fetched() -> None:
    """``torch.load`` hands a ``bytes`` object to libtorch's zip reader,
    whose binding takes it for a *file name* (pybind11 turns bytes into a
    string): ``open file failed ... file path: PK``. So, once, torch.load's
    opener is told to read a `Fetched` through an ``io.BytesIO`` of it;
    paths and other buffers go through as before."""
    try:
        import torch.serialization as serialization
    except ImportError:
        return
    opener = getattr(serialization, "_open_file_like", None)
    if opener is None or getattr(opener, "_stoke_reads_fetched", False):
        return

    def _open_file_like(name_or_buffer, mode):
        if isinstance(name_or_buffer, Fetched):
            name_or_buffer = io.BytesIO(name_or_buffer)
        return opener(name_or_buffer, mode)

    _open_file_like._stoke_reads_fetched = True
    serialization._open_file_like = _open_file_like


class _UploadPath:
    def __init__(self, path: str) -> None:
        self._path = pathlib.Path(path)

    def __enter__(self) -> pathlib.Path:
        self._path.mkdir(parents=True, exist_ok=True)
        return self._path

    def __exit__(self, *exc: Any) -> None:
        return None


class Context(_reducer.ReducerContext):
    """What a processor can reach (Determined's ``TorchBatchProcessorContext``,
    with its metric reducers: ``wrap_reducer``)."""

    def __init__(self, native: Any) -> None:
        import torch

        self._native = native
        self._device = torch.device(native.device)
        self._params = json.loads(native.params_json)

    @property
    def device(self):
        """The ``torch.device`` this processor runs on."""
        return self._device

    @property
    def params(self) -> dict:
        """The spec's ``[processor.params]`` table."""
        return self._params

    @property
    def job_id(self) -> str:
        return self._native.job_id

    @property
    def shard(self) -> str | None:
        """The shard being processed (``None`` in ``__init__`` and ``on_finish``)."""
        return self._native.shard

    @property
    def attempt(self) -> int | None:
        """This shard's attempt number (1 for the first)."""
        return self._native.attempt

    def to_device(self, tensor: Any) -> Any:
        """The tensor on this processor's device (the same tensor when it is there)."""
        if getattr(tensor, "device", None) == self._device:
            return tensor
        return tensor.to(self._device, non_blocking=self._device.type == "cuda")

    def prepare_model_for_inference(self, model: Any) -> Any:
        """Eval mode, on this processor's device; returns the model."""
        model.eval()
        return model.to(self._device)

    def fetch(self, uri: str) -> bytes:
        """A whole object (a model, a vocabulary) from any store URI
        (``file://``, ``s3://``, ``gs://``, ``az://``) or local path."""
        return Fetched(self._native.fetch(str(uri)))

    def upload_path(self) -> contextlib.AbstractContextManager:
        """``with context.upload_path() as path:``: a ``pathlib.Path``
        folder; files left there are uploaded with the next checkpoint."""
        return _UploadPath(self._native.upload_dir)

    def write_rows(self, rows: Any) -> None:
        """Output rows, written with the next checkpoint: a dict of
        columns (lists, numpy arrays, 1-D or 2-D tensors, pyarrow arrays)
        or a pyarrow Table. A string column ``id`` must hold the record ids
        (``batch.ids``)."""
        import pyarrow as pa

        table = _to_arrow(rows)
        if table.num_rows == 0:
            return
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        self._native.write_ipc(sink.getvalue().to_pybytes())

    @property
    def distributed(self) -> "_Distributed":
        """Determined's ``context.distributed``: ``get_rank()`` is this
        worker's index among the job's local workers, ``get_size()`` their
        number (``torch_batch_process(..., workers=N)`` and ``stoke run
        --local N`` set them; a worker started on its own is rank 0 of 1
        unless ``STOKE_WORKER_RANK`` / ``STOKE_WORKER_COUNT`` say more)."""
        return _DISTRIBUTED

    # Determined's spellings.
    def get_distributed_rank(self) -> int:
        return _DISTRIBUTED.get_rank()

    def get_distributed_size(self) -> int:
        return _DISTRIBUTED.get_size()

    def get_tensorboard_path(self) -> pathlib.Path:
        """A folder for TensorBoard event files (Determined's): its files
        are uploaded with the job's outputs at every checkpoint, under
        ``_files/`` of the checkpoint's attempt, named
        ``tensorboard-<rank>-<path>`` (each checkpoint uploads the files
        that changed since the one before)."""
        path = pathlib.Path(self._native.upload_dir).parent / "tensorboard"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _sync_tensorboard(self) -> None:
        """Copies the TensorBoard files that changed into the upload folder
        (called by the worker before each checkpoint)."""
        import shutil

        folder = pathlib.Path(self._native.upload_dir).parent / "tensorboard"
        if not folder.is_dir():
            return
        seen = self.__dict__.setdefault("_tensorboard_seen", {})
        upload = pathlib.Path(self._native.upload_dir)
        upload.mkdir(parents=True, exist_ok=True)
        rank = _DISTRIBUTED.get_rank()
        for path in sorted(folder.rglob("*")):
            if not path.is_file():
                continue
            stat = path.stat()
            key = str(path.relative_to(folder))
            if seen.get(key) == (stat.st_size, stat.st_mtime_ns):
                continue
            seen[key] = (stat.st_size, stat.st_mtime_ns)
            shutil.copyfile(path, upload / f"tensorboard-{rank}-{key.replace('/', '__')}")


class _Distributed:
    """This worker's place among the job's workers (Determined's
    ``DistributedContext`` as far as batch processing uses it)."""

    @staticmethod
    def _env(name: str, default: int) -> int:
        import os

        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default

    def get_rank(self) -> int:
        return self._env("STOKE_WORKER_RANK", 0)

    def get_size(self) -> int:
        return max(1, self._env("STOKE_WORKER_COUNT", 1))

    def get_local_rank(self) -> int:
        return self.get_rank()

    def get_local_size(self) -> int:
        return self.get_size()

    def get_cross_rank(self) -> int:
        return 0

    def get_cross_size(self) -> int:
        return 1


_DISTRIBUTED = _Distributed()


def before_checkpoint(instance: Any) -> None:
    """What the worker runs before a processor's ``on_checkpoint_start``."""
    context = getattr(instance, "context", None)
    if isinstance(context, Context):
        context._sync_tensorboard()


def metrics_reset(instance: Any) -> None:
    """A new attempt starts: the reducers forget what the last one did not
    commit."""
    _reducer.reset(instance)


def metrics_snapshot(instance: Any) -> Any:
    """The reducers' state before a batch (``None`` without reducers)."""
    return _reducer.snapshot(instance)


def metrics_restore(saved: Any) -> None:
    """A call raised ``BadRecord``: what it gathered does not count."""
    _reducer.restore(saved)


def metrics_take(instance: Any, batches: int) -> bytes | None:
    """The checkpoint's metric partial (see ``stoke._reducer``)."""
    return _reducer.take_partial(instance, batches)


def reduce_metrics(blobs: list, shipped: dict | None = None) -> str:
    """The job's metrics as JSON text, from its committed partials in
    record order. ``shipped``: the job's code, loaded first so the
    reducers' classes are there."""
    try:
        metrics = _reducer.reduce_partials(blobs)
    except _reducer.ReduceError as e:
        raise _LoadError(f"reducing the job's metrics: {e}") from None
    return json.dumps(metrics, allow_nan=False, sort_keys=True)


# The module name a spec gives code shipped by value (`[processor] code`).
SHIPPED_MODULE = "__stoke_shipped__"
_SHIPPED: dict[str, dict] = {}


def load_shipped(uri: str, data: bytes) -> dict:
    """The job's code shipped by value (a cloudpickled dict: ``processor``,
    ``dataset``, ``dataloader_kwargs``), loaded once per job and process."""
    shipped = _SHIPPED.get(uri)
    if shipped is None:
        import cloudpickle

        try:
            shipped = cloudpickle.loads(data)
        except Exception as e:
            raise _LoadError(f"loading the job's code from {uri}: {type(e).__name__}: {e}") from None
        if not isinstance(shipped, dict) or "processor" not in shipped:
            raise _LoadError(f"{uri} does not hold a job's code (a dict with the processor class)")
        _SHIPPED.clear()
        _SHIPPED[uri] = shipped
    return shipped


def load(module: str, class_name: str, native: Any, shipped: dict | None = None) -> Any:
    """Imports ``module``, checks ``class_name`` is a TorchBatchProcessor,
    and makes an instance with a fresh context."""
    if module == SHIPPED_MODULE:
        if shipped is None:
            raise _LoadError(f"processor {module}:{class_name} names code shipped by value, but the spec has no [processor] code")
        return shipped["processor"](Context(native))
    if module == _LOCAL_MODULE:
        cls = _LOCAL.get(class_name)
        if cls is None:
            raise _LoadError(f"no class registered as {module}:{class_name} in this process")
        return cls(Context(native))
    mod = importlib.import_module(module)
    cls = getattr(mod, class_name, None)
    if cls is None:
        raise _LoadError(f"module {module!r} ({getattr(mod, '__file__', '?')}) has no attribute {class_name!r}")
    if not isinstance(cls, type) or not issubclass(cls, TorchBatchProcessor):
        kind = "class" if isinstance(cls, type) else type(cls).__name__
        raise _LoadError(
            f"{module}:{class_name} is a {kind} that is not a subclass of stoke.TorchBatchProcessor "
            f"(write `class {class_name}(TorchBatchProcessor)` with `from stoke import TorchBatchProcessor`)"
        )
    return cls(Context(native))


class _LoadError(Exception):
    pass


def make_batch(columns: dict, ids: list, native_ptrs: dict, samples: list | None = None,
               collated: Any = None) -> Batch:
    return Batch(columns, ids, native_ptrs, samples, collated)


def preload_load_fn_module(module: str) -> None:
    """The processor's module, about to be imported for a job with load
    processes: a fork server started ahead imports it at the same time,
    for them (see ``stoke._loading.say_word``)."""
    if module not in (SHIPPED_MODULE, _LOCAL_MODULE):
        _loading.preload_module(module)


def open_load_processes(instance: Any, workers: int) -> Any:
    """The job's load processes for the processor's ``load_fn`` (``None``
    when it defines none; see ``stoke._loading``)."""
    fn = _loading.load_fn_of(instance)
    if fn is None:
        return None
    loads = _loading.LoadProcesses(fn, workers)
    loads.start()
    return loads


def load_submit(loads: Any, columns: dict, n: int, paths: list | None = None) -> Any:
    return loads.submit(columns, n, paths)


def load_results(loads: Any, pending: Any) -> tuple:
    return loads.results(pending)


def bad_record(exc: BaseException):
    """``(record_id, reason)`` when ``exc`` is a ``BadRecord``."""
    if isinstance(exc, BadRecord):
        return (exc.record_id, exc.reason)
    return None


def describe(exc: BaseException, tb: Any = None) -> str:
    """The exception as the worker reports it: the traceback, or the
    message alone for the worker's own load errors."""
    if isinstance(exc, _LoadError):
        return str(exc)
    tb = tb if tb is not None else exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb)).rstrip()


# Classes handed to stoke.torch_batch_process in this process, by the
# name the job spec gives them (`__stoke_local__:C<n>`).
_LOCAL_MODULE = "__stoke_local__"
_LOCAL: dict[str, type] = {}


def register_local_dataset(dataset: Any, dataloader_kwargs: dict) -> str:
    """The spec's ``[dataset] factory`` for a Dataset handed to
    ``torch_batch_process`` in this process."""
    return _dataset.register_local(_LOCAL_MODULE, dataset, dataloader_kwargs)


def open_dataset(factory: str, batch_size: int, count: int, in_worker: bool, shipped: dict | None = None) -> Any:
    """The feed of DataLoader batches for a job's ``format = "python"``
    dataset (see ``stoke._dataset``)."""
    try:
        if factory.partition(":")[0] == SHIPPED_MODULE:
            if shipped is None or "dataset" not in shipped:
                raise _dataset.DatasetError(f"dataset factory {factory} names code shipped by value, but the job's code has no dataset")
            given = (shipped["dataset"], shipped.get("dataloader_kwargs") or {})
            return _dataset.open_feed(factory, _LOCAL_MODULE, batch_size, count, in_worker, given)
        return _dataset.open_feed(factory, _LOCAL_MODULE, batch_size, count, in_worker)
    except _dataset.DatasetError as e:
        raise _LoadError(str(e)) from None


def dataset_batch(feed: Any, indices: list) -> Any:
    return feed.batch(indices)


def register_local(cls: type) -> str:
    for key, known in _LOCAL.items():
        if known is cls:
            return f"{_LOCAL_MODULE}:{key}"
    key = f"C{len(_LOCAL)}"
    _LOCAL[key] = cls
    return f"{_LOCAL_MODULE}:{key}"
