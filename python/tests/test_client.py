"""stoke.Client against a real coordinator and worker."""

import pathlib

import pytest
import stoke
from conftest import fixture_spec

PROCESSORS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"


def test_submit_watch_status_jobs(cluster, fixture_dir):
    client = stoke.Client(cluster.address)
    job = client.submit(fixture_spec(fixture_dir, PROCESSORS))
    assert job["state"] == "running"
    assert job["processor"] == "python:processors:Runner"
    cluster.worker()
    seen = list(client.watch(job["job_id"], poll=0.05))
    assert seen[-1]["state"] == "succeeded", seen[-1]
    assert seen[-1]["records_done"] == 3000
    done = [s["records_done"] for s in seen]
    assert done == sorted(done)
    status = client.status(job["job_id"])
    assert status["state"] == "succeeded" and status["manifest_uri"]
    assert job["job_id"] in [j["job_id"] for j in client.jobs()]


def test_watch_draws_a_progress_bar(cluster, fixture_dir, capsys):
    client = stoke.Client(cluster.address)
    job = client.submit(fixture_spec(fixture_dir))
    cluster.worker()
    last = list(client.watch(job["job_id"], progress=True, poll=0.05))[-1]
    assert last["state"] == "succeeded"
    err = capsys.readouterr().err
    assert job["job_id"] in err and "3000" in err


def test_cancel_pause_resume(cluster, fixture_dir):
    client = stoke.Client(cluster.address)
    job = client.submit(fixture_spec(fixture_dir))["job_id"]
    assert client.pause(job)["state"] == "paused"
    assert client.resume(job)["state"] == "running"
    assert client.cancel(job)["state"] == "cancelled"
    assert client.status(job)["state"] == "cancelled"


def test_errors_are_stoke_errors_with_the_clis_messages(cluster, fixture_dir, tmp_path):
    client = stoke.Client(cluster.address)
    with pytest.raises(stoke.StokeError, match="no-such-job"):
        client.status("no-such-job")
    bad = fixture_spec(fixture_dir)
    bad["processor"]["python"] = "m:C"
    with pytest.raises(stoke.StokeError, match="mutually exclusive"):
        client.submit(bad)
    spec = tmp_path / "bad.toml"
    spec.write_text("[dataset]\nformat = 'range'\ncount = 0\n[processor]\nname = 'x'\n")
    with pytest.raises(stoke.StokeError, match="dataset.count"):
        client.submit(spec)
    with pytest.raises(stoke.StokeError):
        stoke.Client("127.0.0.1:1")
