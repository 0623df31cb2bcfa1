"""stoke.Client: a connection to a coordinator (the `stoke-client`
distribution's Python half; no torch)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Iterator, Mapping

from . import _native_client

StokeError = _native_client.StokeError
JobPaused = _native_client.JobPaused

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
        self._native = _native_client.NativeClient(address, token)

    def submit(self, spec: str | os.PathLike | Mapping[str, Any], job_id: str | None = None) -> dict:
        """Submits a spec: a TOML/JSON file path, or a dict in the spec's
        shape (relative paths in it are relative to the current folder).

        A pipeline spec (``stage`` tables) submits every stage at once, as
        ``stoke submit`` does, and returns the pipeline: ``pipeline`` (its
        id; ``job_id`` sets it), ``state``, ``reason`` and ``stages`` (each
        a job, named ``<pipeline>/<stage>``)."""
        if isinstance(spec, Mapping):
            return json.loads(self._native.submit(json=json.dumps(spec), base=os.getcwd(), job_id=job_id))
        return json.loads(self._native.submit(path=os.fspath(spec), job_id=job_id))

    def status(self, job: str) -> dict:
        """A job (also ``<pipeline>/<stage>``), or a pipeline by its id:
        then its ``state`` and its ``stages`` side by side. A job with a
        price or a deadline has ``cost_so_far``, ``max_cost``,
        ``cost_forecast``, ``finish_by``, ``deadline_slack_s``,
        ``workers_wanted``, ``eta_wanted_s``, ``deadline_at_risk``,
        ``deadline_risk`` and ``events``."""
        return json.loads(self._native.status(job))

    def jobs(self) -> list[dict]:
        return [json.loads(j) for j in self._native.jobs()]

    def cancel(self, job: str) -> dict:
        """Cancels a job, or every stage of a pipeline (given its id)."""
        return json.loads(self._native.cancel(job))

    def pause(self, job: str) -> dict:
        """Pauses a job, or every stage of a pipeline (given its id)."""
        return json.loads(self._native.pause(job))

    def resume(self, job: str) -> dict:
        """Resumes a job, or every stage of a pipeline (given its id)."""
        return json.loads(self._native.resume(job))

    def report(self, job: str) -> dict:
        """The job's efficiency report, as ``stoke report JOB --json``
        prints it: ``wall_s``, ``records``, ``records_per_s``,
        ``busy_fraction``, ``processor_s``, ``seconds`` (processor seconds
        by cause: ``startup``, ``model``, ``input_wait``, ``checkpoint``,
        ``redone``, ``crashed``, ``paused``, ``tail_idle``, ``other``; they
        add up to ``processor_s``), ``shards_split``, ``backups``,
        ``backups_won``, ``attempts_failed``, ``redone_batches``,
        ``devices`` (per worker) and ``metrics`` (the
        processor's metric reducers' results, once the job reduced
        them)."""
        return json.loads(self._native.report(job))

    def set(
        self,
        job: str,
        priority: int | None = None,
        weight: float | None = None,
        max_workers: int | None = None,
        max_cost: float | None = None,
    ) -> dict:
        """Changes a running job's scheduling, as ``stoke set`` does:
        ``priority`` (higher goes first; lower-priority leases may be
        preempted), ``weight`` (its share among running jobs of the same
        priority, positive), ``max_workers`` (most leases it holds at once;
        0 removes the cap), ``max_cost`` (its spending cap, in the
        coordinator's prices; a job paused at its cap resumes when the new
        one is above its spend). Only the arguments given change; with
        none, raises :class:`StokeError`. Returns the job, with its
        ``priority``, ``weight``, ``max_workers``, ``max_cost`` and
        ``queue`` as they are now."""
        return json.loads(
            self._native.set(job, priority=priority, weight=weight, max_workers=max_workers, max_cost=max_cost)
        )

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
