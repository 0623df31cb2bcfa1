"""stoke.Client against a real coordinator and worker."""

import json
import pathlib
import subprocess

import pytest
import stoke
from conftest import DEADLINE, Cluster, bin_path, fixture_spec, wait_for

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
    # Captured, stderr is no terminal: plain lines, no carriage returns.
    assert "\r" not in err, repr(err)
    assert err.splitlines()[-1] == f"{job['job_id']}: succeeded, 3000/3000 records"


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


CAUSES = ("startup", "model", "input_wait", "checkpoint", "redone", "crashed", "paused", "tail_idle", "other")


def test_report_is_the_clis_efficiency_report(cluster, fixture_dir):
    client = stoke.Client(cluster.address)
    job = client.submit(fixture_spec(fixture_dir, PROCESSORS))["job_id"]
    worker = cluster.worker()
    last = list(client.watch(job, poll=0.05))[-1]
    assert last["state"] == "succeeded", last
    # The report is final once the worker is gone (--exit-when-idle: its
    # last heartbeat may still add to it) and the coordinator stored
    # report.json (the job's clock stops then).
    assert worker.wait(timeout=DEADLINE) == 0
    wait_for("report.json", (cluster.root / "jobs" / job / "report.json").exists)
    report = client.report(job)
    assert report["job_id"] == job
    assert report["records"] == 3000
    assert report["wall_s"] > 0 and report["records_per_s"] > 0
    assert 0 <= report["busy_fraction"] <= 1
    assert set(report["seconds"]) == set(CAUSES), report["seconds"]
    for cause in CAUSES:
        assert report["seconds"][cause] >= 0, (cause, report)
    assert report["seconds"]["startup"] > 0 and report["seconds"]["model"] > 0, report
    # An identity, whatever the load: the causes add up to the processor
    # time.
    total, processor_s = sum(report["seconds"].values()), report["processor_s"]
    assert total > 0 and abs(total - processor_s) < 1e-6, report
    assert report["shards_split"] == 0 and report["attempts_failed"] == {}, report
    assert [(d["worker"], d["devices"]) for d in report["devices"]] == [("w1", ["cpu"])], report
    # The same JSON as `stoke report JOB --json`.
    cli = subprocess.run(
        [str(bin_path("stoke")), "--coordinator", cluster.address, "report", job, "--json"],
        check=True, capture_output=True, text=True)
    assert json.loads(cli.stdout) == report
    with pytest.raises(stoke.StokeError, match="no-such-job"):
        client.report("no-such-job")


def test_set_changes_a_jobs_schedule(cluster, fixture_dir):
    client = stoke.Client(cluster.address)
    job = client.submit(fixture_spec(fixture_dir))["job_id"]
    before = client.status(job)
    assert (before["priority"], before["weight"], before["max_workers"]) == (0, 1.0, None)
    assert before["queue"] == "default"
    changed = client.set(job, priority=5, weight=2.5, max_workers=3)
    assert changed["job_id"] == job and changed["state"] == "running"
    assert (changed["priority"], changed["weight"], changed["max_workers"], changed["queue"]) == (5, 2.5, 3, "default")
    status = client.status(job)
    assert (status["priority"], status["weight"], status["max_workers"]) == (5, 2.5, 3)
    # Only what is given changes; max_workers=0 removes the cap.
    uncapped = client.set(job, max_workers=0)
    assert (uncapped["priority"], uncapped["weight"], uncapped["max_workers"]) == (5, 2.5, None)
    assert client.status(job)["max_workers"] is None
    assert client.set(job, priority=-2)["priority"] == -2
    with pytest.raises(stoke.StokeError, match="priority=, weight=, max_workers= or max_cost="):
        client.set(job)
    # A spending cap needs the coordinator's price for the job's pool.
    with pytest.raises(stoke.StokeError, match='no price for pool "default"'):
        client.set(job, max_cost=10.0)
    for bad in (0, -1.0):
        with pytest.raises(stoke.StokeError, match="weight.*must be a positive number"):
            client.set(job, weight=bad)
    with pytest.raises(stoke.StokeError, match="max_workers must be 0"):
        client.set(job, max_workers=-1)
    with pytest.raises(stoke.StokeError, match="no-such-job"):
        client.set("no-such-job", priority=1)
    # The refused changes changed nothing.
    status = client.status(job)
    assert (status["priority"], status["weight"], status["max_workers"]) == (-2, 2.5, None)


def test_a_pipeline_is_submitted_watched_and_steered_whole(cluster, fixture_dir):
    client = stoke.Client(cluster.address)
    job = fixture_spec(fixture_dir)
    prep = {
        "name": "prep",
        "dataset": job["dataset"],
        "processor": {"python": "processors:Features", "python_path": [str(PROCESSORS)]},
        "batching": {"batch_size": 50},
    }
    classify = {"name": "classify", "processor": job["processor"], "batching": {"batch_size": 50}}
    pipeline = client.submit({"name": "pyflow", "stage": [prep, classify]})
    pid = pipeline["pipeline"]
    assert pid.startswith("pyflow-") and pipeline["state"] == "running", pipeline
    assert [s["name"] for s in pipeline["stages"]] == [f"{pid}/prep", f"{pid}/classify"]
    assert [s["job_id"] for s in pipeline["stages"]] == [f"{pid}-prep", f"{pid}-classify"]
    # The whole pipeline pauses and resumes; a stage is reached by name.
    paused = client.pause(pid)
    assert paused["state"] == "paused" and {s["state"] for s in paused["stages"]} == {"paused"}, paused
    assert client.status(f"{pid}/classify")["state"] == "paused"
    assert client.resume(pid)["state"] == "running"
    assert client.set(f"{pid}/classify", max_workers=2)["max_workers"] == 2
    cluster.worker()
    done = wait_for("the pipeline to succeed", lambda: (s := client.status(pid))["state"] == "succeeded" and s)
    assert [s["records_done"] for s in done["stages"]] == [3000, 3000], done
    # A pipeline's id given where a job is expected finds its stages.
    with pytest.raises(stoke.StokeError, match="no-such"):
        client.status("no-such")


def test_client_token_opens_a_coordinator_with_tokens(tmp_path, fixture_dir, monkeypatch):
    client_token, worker_token = "client-" + "a" * 32, "worker-" + "b" * 32
    monkeypatch.delenv("STOKE_CLIENT_TOKEN", raising=False)
    monkeypatch.delenv("STOKE_CLIENT_TOKEN_FILE", raising=False)
    cluster = Cluster(tmp_path, env={"STOKE_CLIENT_TOKEN": client_token, "STOKE_WORKER_TOKEN": worker_token})
    try:
        # No token, or a wrong one: refused, naming what to set.
        for token in (None, "wrong-" + "c" * 32):
            with pytest.raises(stoke.StokeError, match="STOKE_CLIENT_TOKEN"):
                stoke.Client(cluster.address, token=token).jobs()
        client = stoke.Client(cluster.address, token=client_token)
        job = client.submit(fixture_spec(fixture_dir))["job_id"]
        cluster.worker()
        last = list(client.watch(job, poll=0.05))[-1]
        assert last["state"] == "succeeded" and last["records_done"] == 3000, last
    finally:
        cluster.close()
