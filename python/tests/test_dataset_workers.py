"""torch_batch_process with a torch Dataset on local worker processes
(workers=2) and on a running fleet (coordinator=): the processor class
and the dataset shipped by value with cloudpickle, DataLoader workers
inside a worker, kill -9 of a worker, SIGTERM then the same call, a
dataset that does not pickle; and `[dataset] format = "python"` with a
factory, run by `stoke run --local 2`."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading

import pytest

import stoke
from conftest import bin_path, wait_for
from test_dataset import JOB, batches_logged, check_exactly_once, committed, run_job

PROCESSORS = JOB.parent

# A script whose Dataset and processor live in its __main__: they must
# travel by value.
MAIN_SCRIPT = '''
import json, sys, torch
from torch.utils.data import Dataset
from stoke import TorchBatchProcessor, torch_batch_process

class MainSquares(Dataset):
    def __len__(self):
        return 300
    def __getitem__(self, i):
        return torch.tensor([float(i), i / 2.0]), i * i

class MainRecorder(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
    def process_batch(self, batch, batch_idx):
        self.context.write_rows({"id": batch.ids, "label": batch[1], "batch_idx": [batch_idx] * len(batch.ids)})

options = json.loads(sys.argv[2])
report = torch_batch_process(MainRecorder, MainSquares(), root=sys.argv[1], **options)
print(json.dumps(report))
'''


def test_main_classes_on_two_local_workers_with_dataloader_workers(tmp_path):
    script = tmp_path / "main_job.py"
    script.write_text(MAIN_SCRIPT)
    root = tmp_path / "root"
    options = {"batch_size": 16, "checkpoint_interval": 2, "workers": 2, "job_id": "local2",
               "shard_records": 64, "device": "cpu", "dataloader_kwargs": {"num_workers": 2}}
    out = subprocess.run([sys.executable, str(script), str(root), json.dumps(options)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["records"] == 300
    assert (root / "code" / "local2.pkl").exists()
    check_exactly_once(committed(root, "local2"), 300, 16)
    # Two workers took part (one job, five shards).
    workers = {p.name for p in (root / "jobs" / "local2" / "outputs").iterdir()}
    assert len(workers) == 5, workers




def test_a_dataset_that_does_not_pickle_is_refused_at_the_call(tmp_path):
    from dataset_job import Recorder, Squares

    dataset = Squares(10)
    dataset.lock = threading.Lock()
    with pytest.raises(TypeError) as e:
        stoke.torch_batch_process(Recorder, dataset, workers=2, root=tmp_path, device="cpu")
    message = str(e.value)
    assert "the dataset (Squares)" in message and "'lock'" in message, message
    assert 'format = "python"' in message and "factory" in message, message
    assert not (tmp_path / "jobs").exists()


def test_kill_9_of_a_worker_then_its_shards_go_on(tmp_path):
    root = tmp_path / "root"
    hold, go, log = tmp_path / "hold", tmp_path / "go", tmp_path / "batches.log"
    options = {"records": 400, "batch_size": 10, "checkpoint_interval": 2, "job_id": "k9", "workers": 2,
               "shard_records": 100, "device": "cpu"}
    proc = run_job(root, options, {"STOKE_TEST_BATCH_LOG": str(log), "STOKE_TEST_HOLD_AT": "15",
                                    "STOKE_TEST_HOLD_FILE": str(hold), "STOKE_TEST_GO_FILE": str(go)})
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
    check_exactly_once(committed(root, "k9"), 400, 10)
    # The killed worker lost at most its batches since the last checkpoint
    # (2) plus the one it was in.
    logged = batches_logged(log)
    assert len(logged) - len(set(logged)) <= 3, sorted(logged)


def test_kill_9_of_a_worker_with_dataloader_workers_leaves_no_process(tmp_path):
    """Determined's guide as written (DataLoader workers, workers=2), one
    worker killed with kill -9 mid-job, under a subreaper (reap.py): after
    the call returns, no process it started is left, by pid and command
    line; the killed worker's fork server and DataLoader workers among
    them."""
    from reap import descendants

    root, report = tmp_path / "root", tmp_path / "left.json"
    hold, go = tmp_path / "hold", tmp_path / "go"
    options = {"records": 400, "batch_size": 10, "checkpoint_interval": 2, "job_id": "k9dl", "workers": 2,
               "shard_records": 100, "device": "cpu", "dataloader_kwargs": {"num_workers": 2}}
    env = dict(os.environ, STOKE_TEST_HOLD_AT="15", STOKE_TEST_HOLD_FILE=str(hold), STOKE_TEST_GO_FILE=str(go))
    proc = subprocess.Popen([sys.executable, str(PROCESSORS / "reap.py"), str(report), "--",
                             sys.executable, str(JOB), str(root), json.dumps(options)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = int(wait_for("batch 15 to start", lambda: hold.exists() and hold.read_text()))
        # The worker's own processes: its fork server and 2 DataLoader workers.
        started = descendants(pid)
        assert len(started) >= 3, started
        os.kill(pid, signal.SIGKILL)
        go.touch()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    left = json.loads(report.read_text())["left"]
    assert left == [], left
    check_exactly_once(committed(root, "k9dl"), 400, 10)


def test_sigterm_with_workers_then_the_same_call_resumes(tmp_path):
    root = tmp_path / "root"
    hold, go = tmp_path / "hold", tmp_path / "go"
    options = {"records": 300, "batch_size": 10, "checkpoint_interval": 2, "job_id": "wterm", "workers": 2,
               "shard_records": 100, "device": "cpu"}
    proc = run_job(root, options, {"STOKE_TEST_HOLD_AT": "5", "STOKE_TEST_HOLD_FILE": str(hold),
                                    "STOKE_TEST_GO_FILE": str(go)})
    try:
        wait_for("batch 5 to start", hold.exists)
        proc.send_signal(signal.SIGTERM)
        go.touch()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "JobPaused" in err and "job id wterm" in err, err
    status = json.loads((root / "jobs" / "wterm" / "status.json").read_text())
    assert status["state"] == "paused", status
    assert len(committed(root, "wterm")) >= 60
    again = run_job(root, options, {})
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    check_exactly_once(committed(root, "wterm"), 300, 10)


def test_coordinator_runs_the_call_on_a_fleet(cluster, tmp_path):
    from dataset_job import Recorder, Squares

    cluster.worker("w1")
    cluster.worker("w2")
    report = stoke.torch_batch_process(Recorder, Squares(200), batch_size=20, checkpoint_interval=2,
                                       coordinator=cluster.address, root=cluster.root, job_id="fleet",
                                       shard_records=60)
    assert report["records"] == 200
    check_exactly_once(committed(cluster.root, "fleet"), 200, 20)


def test_coordinator_needs_the_fleets_root(tmp_path):
    from dataset_job import Recorder, Squares

    with pytest.raises(ValueError, match="root="):
        stoke.torch_batch_process(Recorder, Squares(10), coordinator="127.0.0.1:1")


def test_a_factory_spec_runs_on_stoke_run_local_2(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text(
        "[dataset]\n"
        'format = "python"\n'
        'factory = "dataset_job:make_dataset"\n'
        "count = 300\n"
        f"python_path = [{str(PROCESSORS)!r}]\n"
        "[processor]\n"
        'python = "dataset_job:Recorder"\n'
        f"python_path = [{str(PROCESSORS)!r}]\n"
        "[batching]\nbatch_size = 16\n"
        "[sharding]\nrecords = 64\n"
    )
    root = tmp_path / "root"
    out = subprocess.run(
        [str(bin_path("stoke")), "run", str(spec), "--local", "2", "--device", "cpu", "--root", str(root),
         "--job-id", "cli"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, STOKE_TEST_RECORDS="300"))
    assert out.returncode == 0, out.stderr
    check_exactly_once(committed(root, "cli"), 300, 16)
    # Each worker of `run --local 2` knows its place: rank 0 or 1 of 2.
    import pyarrow.parquet as pq

    manifest = json.loads((root / "jobs" / "cli" / "manifest.json").read_text())
    places = set()
    for o in manifest["outputs"]:
        if o["uri"].endswith(".parquet"):
            t = pq.read_table(o["uri"].removeprefix("file://")).to_pydict()
            places |= set(zip(t["rank"], t["size"]))
    assert places and places <= {(0, 2), (1, 2)}, places


def test_distributed_rank_and_size_and_tensorboard_files(tmp_path):
    import pyarrow.parquet as pq

    root = tmp_path / "root"
    options = {"records": 200, "batch_size": 10, "checkpoint_interval": 2, "job_id": "ranks", "workers": 2,
               "shard_records": 50, "device": "cpu"}
    proc = run_job(root, options, {})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    manifest = json.loads((root / "jobs" / "ranks" / "manifest.json").read_text())
    uris = [o["uri"].removeprefix("file://") for o in manifest["outputs"]]
    ranks, sizes = set(), set()
    for uri in uris:
        if uri.endswith(".parquet"):
            t = pq.read_table(uri).to_pydict()
            ranks |= set(t["rank"])
            sizes |= set(t["size"])
    assert sizes == {2} and ranks <= {0, 1} and ranks, (ranks, sizes)
    boards = [u for u in uris if "/_files/" in u and "tensorboard-" in u]
    assert boards, uris
    logged = set()
    for u in boards:
        logged |= {int(line) for line in pathlib.Path(u).read_text().split()}
    assert logged <= set(range(20)) and len(logged) >= 10, sorted(logged)
