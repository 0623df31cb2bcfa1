"""Metric reducers (Determined's ``context.wrap_reducer``), counted
exactly once.

A processor registers reducers with ``self.context.wrap_reducer(reducer,
name=None)`` (Determined's ``_PyTorchReducerContext``) and updates them
in ``process_batch``. At each checkpoint the worker takes every reducer's
``per_slot_reduce()`` for the batches since the last one, resets it, and
commits the values, pickled with ``cloudpickle``, as one more object of
that checkpoint (``_metrics/<batch>.pkl`` under the attempt's output
folder): they count exactly when the checkpoint's batches do. When every
shard is committed a worker (or, in process, the caller) runs
:func:`reduce_partials` over every committed partial, in record order:
each reducer's ``cross_slot_reduce`` gets the list of its partials and
the results become the job's ``metrics`` (JSON, ``jobs/<job>/metrics.json``).

Not a public module: ``MetricReducer`` is exported as
``stoke.MetricReducer``.
"""

from __future__ import annotations

import abc
import copy
import math
import pickle
from typing import Any, Callable

# The format of a partial object; a reducer of another format is refused.
PARTIAL_FORMAT = 1


class MetricReducer(metaclass=abc.ABCMeta):
    """A metric computed over a whole job, as Determined's
    ``determined.pytorch.MetricReducer``:

    1. the processor gathers values its own way (``update()``, any method
       it defines) in ``process_batch``;
    2. ``per_slot_reduce()`` turns what was gathered since the last
       ``reset()`` into one picklable value (stoke calls it at every
       checkpoint, for the batches that checkpoint commits, then
       ``reset()``);
    3. ``cross_slot_reduce(per_slot_metrics)`` turns the list of every
       committed checkpoint's value, in record order, into the metric:
       a single value when ``wrap_reducer`` was given a ``name``, a dict
       of metrics when not.

    ``cross_slot_reduce`` may run in another process than the updates (on
    the worker that reduces the job): it must not rely on state beyond
    what it is handed.
    """

    @abc.abstractmethod
    def reset(self) -> None:
        """Forgets what was gathered."""

    @abc.abstractmethod
    def per_slot_reduce(self) -> Any:
        """What was gathered since the last ``reset()``, as one picklable
        value ``cross_slot_reduce`` understands."""

    @abc.abstractmethod
    def cross_slot_reduce(self, per_slot_metrics: list) -> Any:
        """The metric, from every committed ``per_slot_reduce()`` value."""


class _SimpleReducer(MetricReducer):
    """A plain function over a list of values, as a ``MetricReducer``
    (what ``wrap_reducer(fn)`` returns): ``update(value)`` gathers, and
    ``fn`` gets the flat list of every committed value, in record order
    (Determined interleaves its slots' lists instead; stoke's partials are
    consecutive batches, so concatenating them keeps the order)."""

    def __init__(self, fn: Callable[[list], Any]) -> None:
        self.fn = fn
        self.reset()

    def reset(self) -> None:
        self.values: list = []

    def update(self, value: Any) -> None:
        """Gathers one value (for example once per batch)."""
        self.values.append(value)

    def per_slot_reduce(self) -> Any:
        return self.values

    def cross_slot_reduce(self, per_slot_metrics: list) -> Any:
        return self.fn([v for values in per_slot_metrics for v in values])


class _Wrapped:
    """A registered reducer and its name (``None``: it returns a dict)."""

    __slots__ = ("reducer", "name", "for_training", "for_validation")

    def __init__(self, reducer: MetricReducer, name: str | None, for_training: bool, for_validation: bool) -> None:
        self.reducer = reducer
        self.name = name
        self.for_training = for_training
        self.for_validation = for_validation

    def describe(self) -> str:
        reducer = self.reducer
        if isinstance(reducer, _SimpleReducer):
            what = f"reducer function {getattr(reducer.fn, '__qualname__', type(reducer.fn).__name__)}()"
        else:
            what = f"reducer {type(reducer).__qualname__}"
        return f"{what} (name={self.name!r})"


class ReducerContext:
    """The reducer half of a processor's context (Determined's
    ``_PyTorchReducerContext``)."""

    def _reducers(self) -> list:
        return self.__dict__.setdefault("_wrapped_reducers", [])

    def wrap_reducer(
        self,
        reducer: Any,
        name: str | None = None,
        for_training: bool = True,
        for_validation: bool = True,
    ) -> Any:
        """Registers a metric reduced over the whole job, counting only
        committed batches (every worker's, every attempt's), exactly once.

        ``reducer``: a :class:`stoke.MetricReducer` (returned as is), or a
        function of one argument, the flat list of every value given to
        ``.update(value)`` on what this returns (in record order).
        ``name``: the metric's name; ``None`` (the default, as in
        Determined) means the reducer returns a dict of metrics. The
        results appear in the job's report under ``metrics`` (``stoke
        report JOB --json``, and what ``torch_batch_process`` returns);
        they must be JSON: numbers, strings, booleans, lists and dicts of
        them (numpy and torch scalars and arrays are converted).
        ``for_training`` and ``for_validation`` are accepted for
        Determined's code and change nothing (batch processing has one
        kind of workload)."""
        wrapped = self._reducers()
        if any(w.reducer is reducer for w in wrapped):
            raise ValueError(
                f"the same reducer of type {type(reducer).__name__} was given to context.wrap_reducer() twice; wrap each reducer once"
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"wrap_reducer(name=...) must be a str or None, not {type(name).__name__}")
        if name is not None and any(w.name == name for w in wrapped):
            raise ValueError(f"a reducer named {name!r} is already wrapped; give each metric its own name")
        if not isinstance(reducer, MetricReducer):
            if not callable(reducer):
                raise TypeError(
                    f"wrap_reducer() takes a function or a stoke.MetricReducer, not {type(reducer).__name__}"
                )
            reducer = _SimpleReducer(reducer)
        wrapped.append(_Wrapped(reducer, name, for_training, for_validation))
        return reducer


def _described(wrapped: _Wrapped, call: str, e: BaseException) -> ValueError:
    return ValueError(f"{wrapped.describe()} failed in {call}: {type(e).__name__}: {e}")


def _wrapped_of(instance: Any) -> list:
    context = getattr(instance, "context", None)
    if context is None:
        return []
    return context.__dict__.get("_wrapped_reducers", []) if hasattr(context, "__dict__") else []


def reset(instance: Any) -> None:
    """Forgets what the reducers gathered (a new attempt: whatever the
    last one did not commit never counts)."""
    for w in _wrapped_of(instance):
        try:
            w.reducer.reset()
        except Exception as e:
            raise _described(w, "reset()", e) from e


def snapshot(instance: Any) -> Any:
    """The reducers' state before a batch, or ``None`` when there are
    none (see :func:`restore`): a function reducer's number of values, a
    copy of a ``MetricReducer``'s attributes."""
    wrapped = _wrapped_of(instance)
    if not wrapped:
        return None
    saved = []
    for w in wrapped:
        reducer = w.reducer
        if type(reducer) is _SimpleReducer:
            saved.append((reducer, len(reducer.values)))
        elif hasattr(reducer, "__dict__"):
            saved.append((reducer, copy.deepcopy(reducer.__dict__)))
    return saved


def restore(saved: Any) -> None:
    """Puts back the reducers' state from :func:`snapshot`: what a call
    that raised ``BadRecord`` gathered does not count (the batch runs
    again without the record)."""
    if not saved:
        return
    for reducer, state in saved:
        if isinstance(state, int):
            del reducer.values[state:]
        else:
            reducer.__dict__.clear()
            reducer.__dict__.update(state)


def take_partial(instance: Any, batches: int) -> bytes | None:
    """At a checkpoint: every reducer's ``per_slot_reduce()`` for the
    batches since the last one, pickled with the reducers themselves
    (reset, so small) so the job can be reduced anywhere; the reducers are
    reset. ``None`` without reducers or batches."""
    wrapped = _wrapped_of(instance)
    if not wrapped:
        return None
    if batches == 0:
        return None
    import cloudpickle

    entries = []
    for i, w in enumerate(wrapped):
        try:
            value = w.reducer.per_slot_reduce()
        except Exception as e:
            raise _described(w, "per_slot_reduce()", e) from e
        try:
            w.reducer.reset()
        except Exception as e:
            raise _described(w, "reset()", e) from e
        entries.append({"key": f"{i}:{w.name}", "name": w.name, "reducer": w.reducer, "value": value})
    try:
        return cloudpickle.dumps({"format": PARTIAL_FORMAT, "reducers": entries}, protocol=pickle.DEFAULT_PROTOCOL)
    except Exception as e:
        names = ", ".join(w.describe() for w in wrapped)
        raise ValueError(f"pickling the per_slot_reduce() values of {names}: {type(e).__name__}: {e}") from e


class ReduceError(Exception):
    """The job's metrics could not be reduced (the message names the
    reducer)."""


def reduce_partials(blobs: list) -> dict:
    """The job's metrics: each reducer's ``cross_slot_reduce`` over its
    values in every committed partial (``blobs``, in record order), as
    JSON values. Raises :class:`ReduceError` naming the reducer."""
    import cloudpickle

    order: list = []
    by_key: dict = {}
    for n, blob in enumerate(blobs):
        try:
            partial = cloudpickle.loads(blob)
        except Exception as e:
            raise ReduceError(f"loading metric partial {n}: {type(e).__name__}: {e}") from None
        if not isinstance(partial, dict) or partial.get("format") != PARTIAL_FORMAT:
            raise ReduceError(f"metric partial {n} is not in format {PARTIAL_FORMAT}")
        for entry in partial["reducers"]:
            key = entry["key"]
            if key not in by_key:
                by_key[key] = (_Wrapped(entry["reducer"], entry["name"], True, True), [])
                order.append(key)
            by_key[key][1].append(entry["value"])
    metrics: dict = {}
    for key in order:
        wrapped, values = by_key[key]
        try:
            reduced = wrapped.reducer.cross_slot_reduce(values)
        except Exception as e:
            raise ReduceError(f"{wrapped.describe()} failed in cross_slot_reduce(): {type(e).__name__}: {e}") from None
        if wrapped.name is None:
            if not isinstance(reduced, dict):
                raise ReduceError(
                    f"{wrapped.describe()} was wrapped with name=None, so it must return a dict of metrics, "
                    f"but it returned a {type(reduced).__name__}: give wrap_reducer a name for a single metric"
                )
            items = list(reduced.items())
        else:
            if isinstance(reduced, dict):
                raise ReduceError(
                    f"{wrapped.describe()} was wrapped with a name but returned a dict: "
                    "leave name=None for a dict of metrics, or return one value"
                )
            items = [(wrapped.name, reduced)]
        for name, value in items:
            if not isinstance(name, str):
                raise ReduceError(f"{wrapped.describe()} returned a metric named {name!r}: metric names are strings")
            if name in metrics:
                raise ReduceError(f"{wrapped.describe()} returned metric {name!r}, which another reducer returned too")
            try:
                metrics[name] = to_json(value)
            except TypeError as e:
                raise ReduceError(f"{wrapped.describe()} returned metric {name!r} that is not JSON: {e}") from None
    return metrics


def to_json(value: Any) -> Any:
    """``value`` as JSON values: numbers (NaN and infinities become
    ``None``), strings, booleans, ``None``, lists and dicts with string
    keys; numpy and torch scalars and arrays are converted. Raises
    ``TypeError`` naming what is not."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"a dict key {k!r} ({type(k).__name__}) is not a string")
            out[k] = to_json(v)
        return out
    kind = type(value).__module__.split(".")[0]
    if kind in ("numpy", "torch"):
        tolist = getattr(value, "tolist", None)
        if tolist is not None:
            if kind == "torch" and getattr(value, "device", None) is not None and value.device.type != "cpu":
                value = value.detach().cpu()
                tolist = value.tolist
            elif kind == "torch":
                value = value.detach()
                tolist = value.tolist
            return to_json(tolist())
    raise TypeError(f"{type(value).__module__}.{type(value).__qualname__} is not a JSON value ({value!r:.80})")
