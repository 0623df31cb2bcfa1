"""torch_batch_process: a job in this process (the `stoke` distribution's
compiled part; stoke.Client is in `stoke._client`)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping

# torch first: it loads libtorch, which the compiled module links to (one
# libtorch in the process, shared with Python's torch).
import torch  # noqa: F401

from . import _dataset
from . import _fleet
from . import _native
from . import _runtime
from ._signals import stop_on_signals
from .processor import TorchBatchProcessor


# torch_batch_process(..., name=value): where each override goes in the spec.
_OVERRIDES = {
    "batch_size": ("batching", "batch_size"),
    "checkpoint_interval": ("checkpoint", "interval"),
    "max_attempts": ("max_attempts",),
    "shard_records": ("sharding", "records"),
    "output_uri": ("output", "uri"),
    "output_format": ("output", "format"),
    "errors_policy": ("errors", "policy"),
    "threads": ("processor", "threads"),
    "load_workers": ("loading", "workers"),
    "name": ("name",),
}


class _Default(int):
    """Determined's default for ``checkpoint_interval`` (5), told apart
    from the same value given: with a spec, only a value given overrides
    its ``[checkpoint] interval``."""

    def __repr__(self) -> str:
        return str(int(self))


_CHECKPOINT_INTERVAL = _Default(5)


def torch_batch_process(
    batch_processor_cls: type,
    dataset: Any,
    batch_size: int | None = None,
    max_batches: int | None = None,
    checkpoint_interval: int = _CHECKPOINT_INTERVAL,
    dataloader_kwargs: Mapping[str, Any] | None = None,
    *,
    root: str | os.PathLike | None = None,
    job_id: str | None = None,
    workers: int = 0,
    coordinator: str | None = None,
    device: str | None = None,
    params: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> dict:
    """Runs ``batch_processor_cls`` over ``dataset`` and returns the report:
    ``job_id``, ``records``, ``manifest_uri``, ``outputs`` (each ``uri`` and
    ``records``) and ``metrics`` (what the processor's metric reducers,
    ``self.context.wrap_reducer(...)``, reduced to over every committed
    batch, by name). Determined's call, with stoke's additions keyword-only.

    ``dataset``: a map-style ``torch.utils.data.Dataset`` (records are its
    indices; each shard's batches are what ``DataLoader(Subset(dataset,
    shard_indices), batch_size=batch_size, shuffle=False,
    **dataloader_kwargs)`` yields, so ``batch[0]`` is what a plain loop
    gives), or a TOML/JSON spec path or a dict in the spec's shape (its
    ``[processor]`` names no processor: the class given is the processor).
    ``shuffle=True``, ``sampler``, ``batch_sampler`` and ``drop_last=True``
    are refused: the shards own the order. ``max_batches``: process only
    the first ``max_batches`` batches. ``batch_idx`` is the batch's index
    in the job, the same on every resume.

    ``root``: the state folder or store URI (default ``./stoke-state``);
    the same call with the same ``job_id`` and root resumes the job, from
    its last checkpoint, whether it was paused, killed or crashed. SIGTERM
    or Ctrl-C checkpoint after the current batch, pause the job and raise
    :class:`JobPaused`. ``device``: ``cuda:N`` or ``cpu`` (default: the
    first GPU when there is one). Overrides: ``max_attempts``,
    ``shard_records``, ``output_uri``, ``output_format``,
    ``errors_policy``, ``threads``, ``name``, ``load_workers`` (the
    ``[loading] workers`` that run a ``load_fn``); ``params`` are merged
    into ``[processor.params]``. Raises :class:`StokeError` when the job
    fails.
    """
    if not isinstance(batch_processor_cls, type) or not issubclass(batch_processor_cls, TorchBatchProcessor):
        raise TypeError(f"{batch_processor_cls!r} is not a subclass of stoke.TorchBatchProcessor")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be 0 (in this process) or more, got {workers!r}")
    if workers and coordinator is not None:
        raise ValueError("give workers= (local worker processes) or coordinator= (a running fleet), not both")
    shipping = bool(workers) or coordinator is not None
    explicit_interval = not isinstance(checkpoint_interval, _Default)
    shipped: dict = {"processor": batch_processor_cls}
    if isinstance(dataset, (str, os.PathLike, Mapping)):
        if dataloader_kwargs is not None or max_batches is not None:
            raise TypeError("dataloader_kwargs and max_batches are for a torch Dataset, not a job spec")
        if isinstance(dataset, Mapping):
            value = json.loads(json.dumps(dataset))
            base = os.getcwd()
        else:
            path = pathlib.Path(dataset)
            value = _read_spec(path)
            base = str(path.resolve().parent)
        if batch_size is not None:
            overrides["batch_size"] = batch_size
        if explicit_interval:
            overrides["checkpoint_interval"] = checkpoint_interval
    else:
        value, kwargs = _dataset_spec(dataset, batch_size, max_batches, checkpoint_interval, dataloader_kwargs)
        base = os.getcwd()
        if shipping:
            value["dataset"]["factory"] = f"{_runtime.SHIPPED_MODULE}:dataset"
            shipped["dataset"] = dataset
            shipped["dataloader_kwargs"] = kwargs
        else:
            value["dataset"]["factory"] = _runtime.register_local_dataset(dataset, kwargs)
    processor = value.setdefault("processor", {})
    for key in ("name", "python", "python_path", "code"):
        processor.pop(key, None)
    if shipping:
        processor["python"] = f"{_runtime.SHIPPED_MODULE}:{batch_processor_cls.__name__}"
    else:
        processor["python"] = _runtime.register_local(batch_processor_cls)
    if params:
        processor.setdefault("params", {}).update(params)
    for key, val in overrides.items():
        where = _OVERRIDES.get(key)
        if where is None:
            raise TypeError(f"torch_batch_process() got an unknown override {key!r} (known: {', '.join(sorted(_OVERRIDES))})")
        node = value
        for part in where[:-1]:
            node = node.setdefault(part, {})
        node[where[-1]] = val
    if coordinator is not None and root is None:
        raise ValueError(
            "coordinator=: give root=, the fleet's root (or another store URI its workers read): "
            "the processor class and the dataset are written there for the workers to load"
        )
    root = os.fspath(root) if root is not None else os.path.join(os.getcwd(), "stoke-state")
    if device is None:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if shipping:
        job_id = job_id or _fleet.new_job_id(batch_processor_cls)
        processor["code"] = _fleet.ship(shipped, root, job_id)
        if coordinator is not None:
            return _fleet.run_on(coordinator, value, job_id)
        return _fleet.run_local(value, root, job_id, workers, device)
    with stop_on_signals() as signals:
        report = _native.run_embedded(json.dumps(value), base, root, device, None, job_id, signals.path)
    return json.loads(report)


def _dataset_spec(dataset: Any, batch_size: Any, max_batches: Any, checkpoint_interval: Any, dataloader_kwargs: Any) -> tuple[dict, dict]:
    """The job spec for a torch Dataset (``format = "python"``, records
    ``0..len(dataset)`` or the first ``max_batches`` batches; its factory
    left for the caller to name) and the DataLoader arguments."""
    try:
        count = _dataset.check_map_style(dataset)
        kwargs, batch_size = _dataset.check_dataloader_kwargs(dataloader_kwargs, batch_size)
    except _dataset.DatasetError as e:
        raise ValueError(str(e)) from None
    if max_batches is not None:
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
            raise ValueError(f"max_batches must be a positive int, got {max_batches!r}")
        count = min(count, max_batches * batch_size)
    spec = {
        "dataset": {"format": "python", "count": count},
        "processor": {},
        "batching": {"batch_size": batch_size},
        "checkpoint": {"interval": int(checkpoint_interval)},
    }
    return spec, kwargs


def _read_spec(path: pathlib.Path) -> dict:
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    import tomllib

    return tomllib.loads(text)
