"""Metric reducers (Determined's ``context.wrap_reducer``): the Python API
on its own, and jobs in this process whose report carries the metrics,
counted exactly once (a ``BadRecord`` re-run counts the batch once)."""

import json
import pathlib
import sys

import numpy as np
import pytest
import torch

import stoke
from stoke import _reducer

JOB = pathlib.Path(__file__).resolve().parents[2] / "tests" / "python" / "metrics_job.py"
sys.path.insert(0, str(JOB.parent))

from metrics_job import Metered, Numbers, expected  # noqa: E402


class _Holder:
    """A processor-like object with a context, as the worker has."""

    def __init__(self):
        self.context = _reducer.ReducerContext()


class Mean(stoke.MetricReducer):
    def __init__(self):
        self.reset()

    def reset(self):
        self.sum, self.n = 0.0, 0

    def update(self, v):
        self.sum += v
        self.n += 1

    def per_slot_reduce(self):
        return self.sum, self.n

    def cross_slot_reduce(self, per_slot):
        s, n = map(sum, zip(*per_slot))
        return s / n


def test_metric_reducer_is_exported_where_determined_users_import_it():
    assert "MetricReducer" in stoke.__all__
    assert stoke.MetricReducer is _reducer.MetricReducer
    with pytest.raises(TypeError):
        stoke.MetricReducer()  # abstract, as Determined's


def test_wrap_reducer_returns_the_reducer_or_a_wrapper_with_update():
    holder = _Holder()
    mean = Mean()
    assert holder.context.wrap_reducer(mean, name="mean") is mean
    simple = holder.context.wrap_reducer(max, name="max")
    assert isinstance(simple, stoke.MetricReducer) and hasattr(simple, "update")
    with pytest.raises(ValueError, match="twice"):
        holder.context.wrap_reducer(mean, name="again")
    with pytest.raises(ValueError, match="already wrapped"):
        holder.context.wrap_reducer(min, name="max")
    with pytest.raises(TypeError, match="function or a stoke.MetricReducer"):
        holder.context.wrap_reducer(42)


def test_partials_reduce_in_record_order_and_reset_the_reducers():
    holder = _Holder()
    mean = holder.context.wrap_reducer(Mean(), name="mean")
    seen = holder.context.wrap_reducer(list, name="seen")
    blobs = []
    for chunk in ([1, 2], [3], [4, 5, 6]):
        for v in chunk:
            mean.update(v)
            seen.update(v)
        blobs.append(_reducer.take_partial(holder, batches=1))
        assert mean.n == 0 and seen.values == [], "taking a partial resets the reducers"
    # A checkpoint without batches commits no partial.
    assert _reducer.take_partial(holder, batches=0) is None
    assert _reducer.reduce_partials(blobs) == {"mean": 3.5, "seen": [1, 2, 3, 4, 5, 6]}


def test_names_follow_determined_dict_without_a_name_one_value_with_one():
    holder = _Holder()
    holder.context.wrap_reducer(lambda v: {"a": len(v), "b": np.float32(0.5)})
    holder.context.wrap_reducer(lambda v: torch.tensor([1, 2]), name="t")
    for r in holder.context._reducers():
        r.reducer.update(1)
    assert _reducer.reduce_partials([_reducer.take_partial(holder, 1)]) == {"a": 1, "b": 0.5, "t": [1, 2]}

    no_dict = _Holder()
    no_dict.context.wrap_reducer(len)
    with pytest.raises(_reducer.ReduceError, match=r"len\(\) \(name=None\).*must return a dict"):
        _reducer.reduce_partials([_reducer.take_partial(no_dict, 1)])
    named_dict = _Holder()
    named_dict.context.wrap_reducer(lambda v: {"x": 1}, name="x")
    with pytest.raises(_reducer.ReduceError, match="returned a dict"):
        _reducer.reduce_partials([_reducer.take_partial(named_dict, 1)])


def test_a_result_that_is_not_json_names_the_reducer():
    holder = _Holder()
    holder.context.wrap_reducer(lambda v: object(), name="opaque")
    with pytest.raises(_reducer.ReduceError, match=r"<lambda>\(\) \(name='opaque'\) returned metric 'opaque' that is not JSON"):
        _reducer.reduce_partials([_reducer.take_partial(holder, 1)])


def test_json_values_convert_numpy_and_torch_and_refuse_the_rest():
    assert _reducer.to_json({"a": np.int64(3), "b": np.arange(3), "c": torch.tensor(1.5), "d": (1, 2.0)}) == {
        "a": 3, "b": [0, 1, 2], "c": 1.5, "d": [1, 2.0]}
    assert _reducer.to_json(float("nan")) is None
    with pytest.raises(TypeError, match="dict key 1"):
        _reducer.to_json({1: 2})
    with pytest.raises(TypeError, match="is not a JSON value"):
        _reducer.to_json({1, 2})


def test_a_call_that_raised_bad_record_is_undone():
    holder = _Holder()
    mean = holder.context.wrap_reducer(Mean(), name="mean")
    seen = holder.context.wrap_reducer(list, name="seen")
    mean.update(1)
    seen.update(1)
    saved = _reducer.snapshot(holder)
    mean.update(100)
    seen.update(100)
    _reducer.restore(saved)
    assert (mean.sum, mean.n, seen.values) == (1.0, 1, [1])


def test_the_report_of_a_job_in_process_carries_its_metrics(tmp_path):
    n = 95
    report = stoke.torch_batch_process(Metered, Numbers(n), batch_size=10, checkpoint_interval=2,
                                       root=str(tmp_path / "root"), shard_records=30)
    assert report["metrics"] == expected(n)
    stored = json.loads((tmp_path / "root" / "jobs" / report["job_id"] / "metrics.json").read_text())
    assert stored == expected(n)
    # Partials are committed objects, beside the rows, and listed.
    partials = [o["uri"] for o in report["outputs"] if "/_metrics/" in o["uri"]]
    assert partials and all(o["records"] == 0 for o in report["outputs"] if "/_metrics/" in o["uri"])


def test_a_bad_record_under_skip_counts_its_batch_once_without_it(tmp_path):
    n = 40
    report = stoke.torch_batch_process(Metered, Numbers(n), batch_size=10, checkpoint_interval=2,
                                       root=str(tmp_path / "root"), errors_policy="skip", params={"bad": [13]})
    assert report["records_skipped"] == 1
    assert report["metrics"] == expected(n, left_out=[13])


class NotJson(stoke.TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        self.seen = context.wrap_reducer(lambda values: {"where": object()})

    def process_batch(self, batch, batch_idx):
        self.seen.update(len(batch.ids))


def test_a_reducer_whose_result_is_not_json_fails_the_job_naming_it(tmp_path):
    with pytest.raises(stoke.StokeError, match=r"reducer function .*<lambda>\(\) \(name=None\) returned metric 'where' that is not JSON"):
        stoke.torch_batch_process(NotJson, Numbers(20), batch_size=10, root=str(tmp_path / "root"))


def run_metrics_job(root, options, env_extra):
    import os
    import subprocess

    env = dict(os.environ, **env_extra)
    return subprocess.Popen([sys.executable, str(JOB), str(root), json.dumps(options)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_local_workers_with_one_killed_count_each_committed_batch_once(tmp_path):
    """workers=2, one killed with kill -9 while it holds uncommitted
    batches (its reducers' updates for them die with it): the metrics are
    those of a single pass."""
    import os
    import signal

    from conftest import wait_for

    root = tmp_path / "root"
    hold, go = tmp_path / "hold", tmp_path / "go"
    n = 400
    options = {"records": n, "batch_size": 10, "checkpoint_interval": 2, "job_id": "k9m", "workers": 2,
               "shard_records": 100, "device": "cpu"}
    proc = run_metrics_job(root, options, {"STOKE_TEST_HOLD_AT": "15", "STOKE_TEST_HOLD_FILE": str(hold),
                                           "STOKE_TEST_GO_FILE": str(go)})
    try:
        pid = int(wait_for("batch 15 to start", lambda: hold.exists() and hold.read_text()))
        os.kill(pid, signal.SIGKILL)
        go.touch()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["metrics"] == expected(n)


def test_stoke_run_local_2_reduces_on_a_worker_and_stoke_report_shows_the_metrics(tmp_path):
    """A spec run by the CLI (no Python in it): a worker reduces; `stoke
    report` prints the metrics and `--json` has them under `metrics`."""
    import os
    import subprocess

    from conftest import bin_path

    processors = JOB.parent
    spec = tmp_path / "job.toml"
    spec.write_text(
        "[dataset]\n"
        'format = "python"\n'
        'factory = "metrics_job:make_dataset"\n'
        "count = 250\n"
        f"python_path = [{str(processors)!r}]\n"
        "[processor]\n"
        'python = "metrics_job:Metered"\n'
        f"python_path = [{str(processors)!r}]\n"
        "[batching]\nbatch_size = 10\n"
        "[checkpoint]\ninterval = 3\n"
        "[sharding]\nrecords = 60\n"
    )
    root = tmp_path / "root"
    env = dict(os.environ, STOKE_TEST_RECORDS="250")
    out = subprocess.run(
        [str(bin_path("stoke")), "run", str(spec), "--local", "2", "--device", "cpu", "--root", str(root),
         "--job-id", "cli"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads((root / "jobs" / "cli" / "metrics.json").read_text()) == expected(250)
    as_json = subprocess.run([str(bin_path("stoke")), "report", "cli", "--json", "--root", str(root)],
                             capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["metrics"] == expected(250)
    plain = subprocess.run([str(bin_path("stoke")), "report", "cli", "--root", str(root)],
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0, plain.stderr
    assert "metrics:" in plain.stdout and "label_sum" in plain.stdout and "[250,250]" in plain.stdout, plain.stdout
