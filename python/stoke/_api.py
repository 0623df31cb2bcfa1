"""Client and torch_batch_process (the compiled part of the package)."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Any, Iterator, Mapping

# torch first: it loads libtorch, which the compiled module links to (one
# libtorch in the process, shared with Python's torch).
import torch  # noqa: F401

from . import _native
from . import _runtime

StokeError = _native.StokeError

_TERMINAL = {"succeeded", "failed", "cancelled"}


class Client:
    """A connection to a stoke coordinator (``host:port`` or a URL).

    ``token`` defaults to ``STOKE_CLIENT_TOKEN`` / ``STOKE_CLIENT_TOKEN_FILE``;
    TLS settings come from the environment as for the CLI. Errors raise
    :class:`StokeError` with the CLI's messages. Jobs are dicts (``job_id``,
    ``state``, ``records_done``, ``records_total`` (and, while it is unknown,
    ``records_total_estimate``), ``reason``, the schedule:
    ``priority``, ``weight``, ``max_workers``, ``queue``, ...).
    """

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self._native = _native.NativeClient(address, token)

    def submit(self, spec: str | os.PathLike | Mapping[str, Any], job_id: str | None = None) -> dict:
        """Submits a spec: a TOML/JSON file path, or a dict in the spec's
        shape (relative paths in it are relative to the current folder)."""
        if isinstance(spec, Mapping):
            return json.loads(self._native.submit(json=json.dumps(spec), base=os.getcwd(), job_id=job_id))
        return json.loads(self._native.submit(path=os.fspath(spec), job_id=job_id))

    def status(self, job: str) -> dict:
        return json.loads(self._native.status(job))

    def jobs(self) -> list[dict]:
        return [json.loads(j) for j in self._native.jobs()]

    def cancel(self, job: str) -> dict:
        return json.loads(self._native.cancel(job))

    def pause(self, job: str) -> dict:
        return json.loads(self._native.pause(job))

    def resume(self, job: str) -> dict:
        return json.loads(self._native.resume(job))

    def report(self, job: str) -> dict:
        """The job's efficiency report, as ``stoke report JOB --json``
        prints it: ``wall_s``, ``records``, ``records_per_s``,
        ``busy_fraction``, ``processor_s``, ``seconds`` (processor seconds
        by cause: ``startup``, ``model``, ``input_wait``, ``checkpoint``,
        ``redone``, ``crashed``, ``paused``, ``tail_idle``, ``other``; they
        add up to ``processor_s``), ``shards_split``, ``attempts_failed``,
        ``redone_batches`` and ``devices`` (per worker)."""
        return json.loads(self._native.report(job))

    def set(
        self,
        job: str,
        priority: int | None = None,
        weight: float | None = None,
        max_workers: int | None = None,
    ) -> dict:
        """Changes a running job's scheduling, as ``stoke set`` does:
        ``priority`` (higher goes first; lower-priority leases may be
        preempted), ``weight`` (its share among running jobs of the same
        priority, positive), ``max_workers`` (most leases it holds at once;
        0 removes the cap). Only the arguments given change; with none,
        raises :class:`StokeError`. Returns the job, with its ``priority``,
        ``weight``, ``max_workers`` and ``queue`` as they are now."""
        return json.loads(self._native.set(job, priority=priority, weight=weight, max_workers=max_workers))

    def watch(self, job: str, progress: bool = False, poll: float = 0.5) -> Iterator[dict]:
        """Yields the job's status every ``poll`` seconds until it ends
        (the last one yielded is terminal). With ``progress=True`` a bar
        is drawn on stderr (tqdm's when installed)."""
        bar = _Bar(job) if progress else None
        try:
            while True:
                info = self.status(job)
                if bar is not None:
                    bar.update(info)
                yield info
                if info["state"] in _TERMINAL:
                    return
                time.sleep(poll)
        finally:
            if bar is not None:
                bar.close()


class _Bar:
    """A progress bar on a terminal; on a pipe or a file (a log, a CI job),
    one plain line per change instead, as the CLI does."""

    def __init__(self, job: str) -> None:
        self._job = job
        self._tqdm = None
        self._tty = sys.stderr.isatty()
        self._last = None
        if not self._tty:
            return
        try:
            from tqdm import tqdm

            self._tqdm = tqdm(desc=job, unit="rec", file=sys.stderr)
        except ImportError:
            pass

    def update(self, info: dict) -> None:
        done, total = info["records_done"], info.get("records_total")
        # A total not counted up front: the coordinator's estimate from bytes.
        estimate = info.get("records_total_estimate") if total is None else None
        if self._tqdm is not None:
            if total is not None or estimate is not None:
                self._tqdm.total = total if total is not None else estimate
            self._tqdm.n = done
            self._tqdm.set_postfix_str(info["state"])
            self._tqdm.refresh()
            return
        if not self._tty:
            shown = total if total is not None else f"~{estimate}" if estimate is not None else "?"
            line = f"{self._job}: {info['state']}, {done}/{shown} records"
            if line != self._last:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()
                self._last = line
            return
        width = 30
        if total:
            filled = int(width * done / max(total, 1))
            line = f"{self._job} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {info['state']}"
        else:
            line = f"{self._job} {done} records {info['state']}"
        sys.stderr.write("\r" + line)
        sys.stderr.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._tty:
            sys.stderr.write("\n")


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
    "name": ("name",),
}


def torch_batch_process(
    batch_processor_cls: type,
    spec: str | os.PathLike | Mapping[str, Any],
    *,
    root: str | os.PathLike | None = None,
    device: str = "cpu",
    job_id: str | None = None,
    params: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> dict:
    """Runs a job with ``batch_processor_cls`` in this process, as
    ``stoke run --embedded`` does (the same coordinator state machine and
    worker pipeline), and returns the report: ``job_id``, ``records``,
    ``manifest_uri``, ``outputs`` (each ``uri`` and ``records``).

    ``spec``: a TOML/JSON spec file or a dict in the spec's shape (its
    ``[processor]`` names no processor: the class given is the processor).
    ``root``: the state folder or store URI (default ``./stoke-state``);
    running again with the same ``job_id`` and root resumes the job.
    Overrides: ``batch_size``, ``checkpoint_interval``, ``max_attempts``,
    ``shard_records``, ``output_uri``, ``output_format``, ``errors_policy``,
    ``threads``, ``name``; ``params`` are merged into
    ``[processor.params]``. Raises :class:`StokeError` when the job fails.
    """
    from .processor import TorchBatchProcessor

    if not isinstance(batch_processor_cls, type) or not issubclass(batch_processor_cls, TorchBatchProcessor):
        raise TypeError(f"{batch_processor_cls!r} is not a subclass of stoke.TorchBatchProcessor")
    if isinstance(spec, Mapping):
        value = json.loads(json.dumps(spec))
        base = os.getcwd()
    else:
        path = pathlib.Path(spec)
        value = _read_spec(path)
        base = str(path.resolve().parent)
    processor = value.setdefault("processor", {})
    for key in ("name", "python", "python_path"):
        processor.pop(key, None)
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
    root = os.fspath(root) if root is not None else os.path.join(os.getcwd(), "stoke-state")
    report = _native.run_embedded(json.dumps(value), base, root, device, None, job_id)
    return json.loads(report)


def _read_spec(path: pathlib.Path) -> dict:
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    import tomllib

    return tomllib.loads(text)
