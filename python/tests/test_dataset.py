"""torch_batch_process with a map-style torch Dataset, in this process
(Determined's call): DataLoader batches, refusals, max_batches, stable
batch_idx, SIGTERM then the same call again, kill -9 then the same call."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, SequentialSampler

import stoke
from conftest import wait_for

JOB = pathlib.Path(__file__).resolve().parents[2] / "tests" / "python" / "dataset_job.py"
sys.path.insert(0, str(JOB.parent))

from dataset_job import Recorder, Squares  # noqa: E402


def committed(root, job_id):
    """id -> (label, batch_idx) over the committed outputs of a job (its
    manifest when it finished, else each shard's latest progress record)."""
    job = pathlib.Path(root) / "jobs" / job_id
    manifest = job / "manifest.json"
    if manifest.exists():
        uris = [o["uri"] for o in json.loads(manifest.read_text())["outputs"]]
    else:
        latest = {}
        for p in (job / "progress").glob("*.json"):
            for record in json.loads(p.read_text()).get("records", []):
                known = latest.get(record["shard_id"])
                if known is None or record["seq"] > known["seq"]:
                    latest[record["shard_id"]] = record
        uris = [o["uri"] for r in latest.values() for o in r["outputs"]]
    out = {}
    for uri in uris:
        path = uri.removeprefix("file://")
        if not path.endswith(".parquet"):
            continue
        t = pq.read_table(path).to_pydict()
        for i, rid in enumerate(t["id"]):
            assert rid not in out, f"record {rid} committed twice"
            out[rid] = (t["label"][i], t["batch_idx"][i])
    return out


def check_exactly_once(rows, n, batch_size):
    assert sorted(int(r) for r in rows) == list(range(n))
    for rid, (label, batch_idx) in rows.items():
        assert label == int(rid) ** 2
        assert batch_idx == int(rid) // batch_size


def test_dataset_in_process_with_dataloader_workers(tmp_path):
    # Several shards (shard_records), a partial last batch, and torch's
    # DataLoader with two worker processes.
    report = stoke.torch_batch_process(
        Recorder, Squares(300), batch_size=16, checkpoint_interval=2,
        dataloader_kwargs={"num_workers": 2, "prefetch_factor": 2},
        root=tmp_path, job_id="ds", shard_records=64, device="cpu")
    assert report["records"] == 300
    check_exactly_once(committed(tmp_path, "ds"), 300, 16)


def test_max_batches_and_batch_size_in_kwargs(tmp_path):
    report = stoke.torch_batch_process(
        Recorder, Squares(300), None, 4, dataloader_kwargs={"batch_size": 10}, root=tmp_path, job_id="mb", device="cpu")
    assert report["records"] == 40
    rows = committed(tmp_path, "mb")
    check_exactly_once(rows, 40, 10)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    "kwargs, dataset, message",
    [
        ({"dataloader_kwargs": {"shuffle": True}}, Squares(10), "shuffle=True"),
        ({"dataloader_kwargs": {"sampler": SequentialSampler(range(10))}}, Squares(10), "sampler"),
        ({"dataloader_kwargs": {"batch_sampler": [[0, 1]]}}, Squares(10), "batch_sampler"),
        ({"dataloader_kwargs": {"drop_last": True}}, Squares(10), "drop_last"),
        ({"batch_size": 4, "dataloader_kwargs": {"batch_size": 8}}, Squares(10), "batch_size given twice"),
        ({}, Stream(), "IterableDataset"),
        ({}, Squares(0), "empty"),
        ({}, object(), "not a map-style Dataset"),
    ],
)
def test_refusals(tmp_path, kwargs, dataset, message):
    with pytest.raises(ValueError, match=message):
        stoke.torch_batch_process(Recorder, dataset, root=tmp_path, device="cpu", **kwargs)
    assert not (tmp_path / "jobs").exists()


def run_job(root, options, env_extra, **popen):
    env = dict(os.environ, **env_extra)
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen([sys.executable, str(JOB), str(root), json.dumps(options)], env=env, **popen)


def batches_logged(path):
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_stopped_then_the_same_call_resumes(tmp_path, how):
    root = tmp_path / "root"
    options = {"records": 400, "batch_size": 10, "checkpoint_interval": 3, "job_id": "resume", "device": "cpu"}
    hold, go = tmp_path / "hold", tmp_path / "go"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    # stderr to a file, read while the call runs: SIGTERM is heard on a
    # thread of its own, and batch 13 goes on only once it has been.
    err_path = tmp_path / "first.err"
    with open(err_path, "w") as err_file:
        proc = run_job(root, options, {
            "STOKE_TEST_BATCH_LOG": str(first_log), "STOKE_TEST_HOLD_AT": "13",
            "STOKE_TEST_HOLD_FILE": str(hold), "STOKE_TEST_GO_FILE": str(go)}, stderr=err_file)
    try:
        wait_for("batch 13 to start", hold.exists)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
            wait_for("the SIGTERM to be heard", lambda: "stoke: stopping (SIGTERM)" in err_path.read_text())
            go.touch()
            proc.communicate(timeout=120)
            err = err_path.read_text()
            assert proc.returncode != 0
            assert "JobPaused" in err and "paused after its last checkpoint" in err, err
            assert "job id resume" in err and str(root) in err, err
            status = json.loads((root / "jobs" / "resume" / "status.json").read_text())
            assert status["state"] == "paused", status
        else:
            proc.kill()
            proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    before = committed(root, "resume")
    first = batches_logged(first_log)
    assert 13 in first
    if how == "sigterm":
        # The batch running at SIGTERM was finished and checkpointed.
        assert len(before) == 140
    else:
        # kill -9 loses at most one checkpoint interval (3 batches).
        assert len(before) >= 140 - 3 * 10
    again = run_job(root, options, {"STOKE_TEST_BATCH_LOG": str(second_log)})
    out, err = again.communicate(timeout=180)
    assert again.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["records"] == 400
    check_exactly_once(committed(root, "resume"), 400, 10)
    redone = set(first) & set(batches_logged(second_log))
    assert len(redone) <= (0 if how == "sigterm" else 3), sorted(redone)
