"""Graphbook's load_fn for Python processors: run per record on a pool of
load processes ahead of the model, results as batch.samples in record
order; `[loading] workers` / load_workers=; a raising load_fn and a dying
load process under the job's [errors] policy."""

import json
import os
import pathlib
import sys

import pyarrow.parquet as pq
import pytest

import stoke

PROCESSORS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"
sys.path.insert(0, str(PROCESSORS))

from load_job import Squares  # noqa: E402


def dataset(tmp_path, n=200, faults=None):
    faults = faults or {}
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "x": i, "fault": faults.get(i, "")}) + "\n" for i in range(n)))
    return path


def spec(data, **extra):
    value = {"dataset": {"format": "jsonl", "uri": str(data), "id_column": "id"},
             "processor": {}, "sharding": {"bytes": "2KiB"}}
    value.update(extra)
    return value


def outputs(report, columns=("x", "square", "pid")):
    """The committed rows by id, each a tuple of ``columns`` (a dict of
    every column with ``columns=None``); a record committed twice fails."""
    out = {}
    for o in report["outputs"]:
        t = pq.read_table(o["uri"].removeprefix("file://")).to_pydict()
        for i, rid in enumerate(t["id"]):
            assert rid not in out, f"{rid} twice"
            out[rid] = {name: t[name][i] for name in t} if columns is None else tuple(t[c][i] for c in columns)
    return out


@pytest.mark.parametrize("load_workers", [0, 2])
def test_samples_in_record_order_from_the_load_processes(tmp_path, load_workers):
    report = stoke.torch_batch_process(Squares, spec(dataset(tmp_path)), batch_size=16, root=tmp_path / "root",
                                       device="cpu", load_workers=load_workers)
    rows = outputs(report)
    assert sorted(rows) == sorted(f"r{i}" for i in range(200))
    for rid, (x, square, pid) in rows.items():
        assert rid == f"r{x}" and square == x * x
    pids = {pid for _, _, pid in rows.values()}
    if load_workers == 0:
        assert pids == {os.getpid()}
    else:
        # Other processes than this one, and more than one.
        assert os.getpid() not in pids and len(pids) >= 2, pids


def test_a_raising_load_fn_is_a_bad_record_under_skip(tmp_path):
    report = stoke.torch_batch_process(Squares, spec(dataset(tmp_path, faults={37: "raise"}), errors={"policy": "skip"}), batch_size=16,
                                       root=tmp_path / "root", device="cpu", load_workers=2, job_id="skip")
    rows = outputs(report)
    assert "r37" not in rows and len(rows) == 199
    assert report["records_skipped"] == 1
    errors = list((tmp_path / "root" / "jobs" / "skip" / "errors").rglob("*"))
    text = "".join(p.read_text() for p in errors if p.is_file())
    assert "r37" in text and "cannot load x=37" in text and "Traceback" in text, text


def test_a_raising_load_fn_fails_the_job_under_fail(tmp_path):
    with pytest.raises(stoke.StokeError) as e:
        stoke.torch_batch_process(Squares, spec(dataset(tmp_path, 40, faults={5: "raise"})), batch_size=16, root=tmp_path / "root",
                                  device="cpu", load_workers=2, max_attempts=1)
    assert "r5" in str(e.value) and "cannot load x=5" in str(e.value), str(e.value)


def test_a_dying_load_process_is_replaced_and_its_record_is_an_error(tmp_path):
    report = stoke.torch_batch_process(Squares, spec(dataset(tmp_path, faults={50: "die"}), errors={"policy": "skip"}), batch_size=16,
                                       root=tmp_path / "root", device="cpu", load_workers=2, job_id="die")
    rows = outputs(report)
    assert "r50" not in rows and len(rows) == 199
    assert report["records_skipped"] == 1


def test_json_lists_arrive_as_tensors_and_pad(tmp_path):
    from tensor_job import Shapes

    path = tmp_path / "lists.jsonl"
    rows = [{"id": f"r{i}", "features": [i + k / 100 for k in range(48)], "tokens": list(range(i % 5 + 1))}
            for i in range(100)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = stoke.torch_batch_process(Shapes, {"dataset": {"format": "jsonl", "uri": str(path), "id_column": "id"},
                                                "processor": {}}, batch_size=16, root=tmp_path / "root", device="cpu")
    got = outputs(report, ("first", "length", "token_sum"))
    assert len(got) == 100
    for i in range(100):
        n = i % 5 + 1
        assert got[f"r{i}"] == (pytest.approx(float(i)), n, n * (n - 1) // 2)


TEARDOWN_PROBE = '''
import os

open(os.environ["PROBE_DIR"] + f"/imported-{os.getpid()}", "w").close()


class _AtTeardown:
    # What __del__ needs, held here: teardown may have cleared the globals.
    def __del__(self, _open=open, _path=os.environ["PROBE_DIR"] + f"/torn-down-{os.getpid()}"):
        _open(_path, "w").close()


probe = _AtTeardown()
'''

START_SERVER = '''
import os
from stoke import _loading
pid = _loading.start_fork_server(["teardown_probe"])
ctx = _loading.fork_server()
# A process forked from the server: its preload (torch, the probe) is done.
p = ctx.Process(target=os.getpid)
p.start()
p.join()
print(pid, flush=True)
'''


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_the_fork_server_leaves_without_finalising_torch(tmp_path):
    """The fork server's end skips the interpreter's teardown (half a
    second with torch imported, while it holds the worker's output pipe):
    a module it preloaded is never torn down, where the same module in a
    plain Python process is."""
    import subprocess
    import time

    (tmp_path / "teardown_probe.py").write_text(TEARDOWN_PROBE)
    env = dict(os.environ, PROBE_DIR=str(tmp_path))
    # The probe sees a plain interpreter's teardown.
    env["PYTHONPATH"] = str(tmp_path)
    plain = subprocess.run([sys.executable, "-c", "import teardown_probe; import os; print(os.getpid())"],
                           env=env, capture_output=True, text=True, check=True)
    assert (tmp_path / f"torn-down-{plain.stdout.strip()}").exists()
    # On PYTHONPATH: the server (Python 3.11's) does not take its parent's
    # sys.path for its preload.
    out = subprocess.run([sys.executable, "-c", START_SERVER], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    server = int(out.stdout.strip())
    assert (tmp_path / f"imported-{server}").exists(), list(tmp_path.iterdir())
    # Its parent has ended: the server leaves, without the teardown.
    deadline = time.monotonic() + 60
    while not _gone(server):
        assert time.monotonic() < deadline, f"the fork server {server} is still running"
        time.sleep(0.05)
    assert not (tmp_path / f"torn-down-{server}").exists()


WORD_PROBE = '''
import os

import torch

# Each process that imports this module itself leaves a file.
open(os.environ["PROBE_DIR"] + f"/imported-{os.getpid()}", "w").close()


def load(item):
    return torch.tensor([float(item["x"]), float(os.getpid())])
'''

WORD_RUN = '''
import os
import sys

from stoke import _loading

server = _loading.start_fork_server()
# The job's python_path, known only after the server started.
sys.path.insert(0, os.environ["PROBE_DIR"])
if sys.argv[1] == "early":
    # A worker says the processor's module before it imports it itself.
    _loading.preload_module("word_probe")
import word_probe

pool = _loading.LoadProcesses(word_probe.load, 2)
pool.start()
try:
    results, _ = pool.results(pool.submit({"x": [1, 2, 3]}, 3))
finally:
    pool.close()
print(server, " ".join(str(int(v[1])) for ok, v in results if ok), flush=True)
'''


@pytest.mark.parametrize("when", ["early", "at-pool-start"])
def test_a_fork_server_started_ahead_imports_load_fns_module_once(tmp_path, when):
    """A fork server started before the job is known (a worker's
    ``--python-prewarm-loading``) waits, before it forks any load process,
    for the worker's word: ``load_fn``'s module, and the ``sys.path`` to
    import it from. It imports the module then, so the load processes
    have it (and what it imports) without importing it each."""
    import subprocess

    (tmp_path / "word_probe.py").write_text(WORD_PROBE)
    env = dict(os.environ, PROBE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", WORD_RUN, when], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    server, *loaders = (int(p) for p in out.stdout.split())
    assert len(loaders) == 3 and server not in loaders, out.stdout
    imported = sorted(int(p.name.removeprefix("imported-")) for p in tmp_path.glob("imported-*"))
    # This process and the server; none of the load processes.
    assert server in imported and len(imported) == 2, (imported, server, loaders)
    assert not set(loaders) & set(imported), (imported, loaders)


def test_a_fork_server_waiting_for_its_word_leaves_with_its_worker(tmp_path):
    """A worker that ends before it says the word (no job used load
    processes) takes its waiting fork server with it, and the folder the
    word would have come through."""
    import subprocess
    import time

    from stoke import _fork_word

    run = "import os\nfrom stoke import _loading\nprint(os.getpid(), _loading.start_fork_server(), flush=True)\n"
    out = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    worker, server = (int(p) for p in out.stdout.split())
    deadline = time.monotonic() + 60
    while not _gone(server) or os.path.exists(_fork_word.folder_for(worker)):
        assert time.monotonic() < deadline, f"the fork server {server} still waits for its word"
        time.sleep(0.05)


@pytest.mark.parametrize("load_workers", [0, 2])
def test_a_files_dataset_gives_load_fn_each_files_bytes(tmp_path, load_workers):
    """A local ``files`` dataset: each load process reads its records'
    files itself (the bytes do not cross a pipe), and ``load_fn`` gets
    the same ``uri`` and ``bytes`` as ever; the batch keeps its ``bytes``."""
    import urllib.parse
    import zlib

    from load_job import FileDigests

    folder = tmp_path / "files"
    folder.mkdir()
    want = {}
    for i in range(60):
        # Names a URI must escape, too.
        name = f"f {i:02d}%{'x' * (i % 3)}.bin"
        data = os.urandom(100 + 37 * i)
        (folder / name).write_bytes(data)
        want[name] = (len(data), zlib.crc32(data))
    report = stoke.torch_batch_process(FileDigests, {"dataset": {"format": "files", "uri": str(folder)}, "processor": {}},
                                       batch_size=16, root=tmp_path / "root", device="cpu", load_workers=load_workers)
    got = outputs(report, ("size", "crc", "column_crc", "pid"))
    assert len(got) == 60
    for rid, (size, crc, column_crc, pid) in got.items():
        name = urllib.parse.unquote(rid.rsplit("/", 1)[-1])
        assert (size, crc) == want[name], rid
        assert column_crc == crc, rid
        assert (pid == os.getpid()) == (load_workers == 0), rid


@pytest.mark.parametrize("load_workers", [0, 2])
def test_batch_collated_is_the_load_process_batch_without_a_copy(tmp_path, load_workers):
    """With load processes, ``batch.collated`` is the tensor the load
    process stacked the batch into, in shared memory, and the samples are
    views of it; in the processor's own thread it is the samples stacked.
    Either way it equals ``torch.stack(batch.samples)``."""
    from load_job import Collated

    report = stoke.torch_batch_process(Collated, spec(dataset(tmp_path)), batch_size=16, root=tmp_path / "root",
                                       device="cpu", load_workers=load_workers)
    rows = outputs(report, None)
    assert sorted(rows) == sorted(f"r{i}" for i in range(200))
    for rid, row in rows.items():
        assert rid == f"r{row['x']}" and row["equal"], (rid, row)
        assert row["shared"] == row["view"] == (load_workers > 0), (rid, row)


def test_batch_collated_without_a_record_whose_load_fn_raised(tmp_path):
    """Under ``skip``, the batch that lost r37 to a raising ``load_fn`` is
    stacked again from the samples left (not shared, not the load
    process's tensor); every other batch is the load process's own."""
    from load_job import Collated

    report = stoke.torch_batch_process(Collated, spec(dataset(tmp_path, faults={37: "raise"}), errors={"policy": "skip"}),
                                       batch_size=16, root=tmp_path / "root", device="cpu", load_workers=2)
    rows = outputs(report, None)
    assert "r37" not in rows and len(rows) == 199
    restacked = {rid for rid, row in rows.items() if not row["shared"]}
    # r37's batch alone: its 15 other records, with a neighbour of r37.
    assert len(restacked) == 15 and all(rows[rid]["size"] == 15 for rid in restacked), sorted(restacked)
    assert "r36" in restacked or "r38" in restacked, sorted(restacked)
    assert all(row["equal"] and row["view"] == row["shared"] for row in rows.values())


def test_batch_collated_collates_dict_samples_as_default_collate(tmp_path):
    from load_job import CollatedDicts

    report = stoke.torch_batch_process(CollatedDicts, spec(dataset(tmp_path, 50)), batch_size=16, root=tmp_path / "root",
                                       device="cpu", load_workers=2)
    rows = outputs(report, None)
    assert sorted(rows) == sorted(f"r{i}" for i in range(50))
    assert all(row["name"] == f"n{row['x']}" and rid == f"r{row['x']}" for rid, row in rows.items())


def test_a_dead_load_process_replaces_the_pool_once():
    """Every batch in flight on a pool whose load process died fails with
    ``BrokenProcessPool``. The pool is replaced once: a second failed batch
    of the broken pool must not replace (shut down) the new one, which may
    already hold batches submitted after the first replacement."""
    import signal

    import torch

    from stoke import _loading

    def load(item):
        if item["kind"] == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([float(item["x"])])

    pool = _loading.LoadProcesses(load, 1)
    try:
        a = pool.submit({"x": [0, 1], "kind": ["ok", "die"]}, 2)
        # Behind a on the one load process: it fails with the pool.
        b = pool.submit({"x": [2, 3], "kind": ["ok", "ok"]}, 2)
        broken = a.executor
        got, collated = pool.results(a)
        assert collated is None
        assert got[0][0] and torch.equal(got[0][1], torch.tensor([0.0]))
        assert not got[1][0] and "died" in got[1][1], got[1]
        # Submitted to a new pool (r1, tried alone, broke one more) before
        # b's failure is seen.
        c = pool.submit({"x": [4, 5], "kind": ["ok", "ok"]}, 2)
        fresh = c.executor
        assert fresh is not broken
        got, _ = pool.results(b)
        assert [ok for ok, _ in got] == [True, True]
        assert [float(v) for _, v in got] == [2.0, 3.0]
        assert pool._executor is fresh, "the new pool was replaced for a batch of the broken one"
        got, collated = pool.results(c)
        assert [float(v) for _, v in got] == [4.0, 5.0]
        assert torch.equal(collated, torch.tensor([[4.0], [5.0]]))
    finally:
        pool.close()


@pytest.mark.parametrize("load_workers", [1, 2])
def test_load_processes_run_a_bounded_number_of_batches_ahead(tmp_path, load_workers):
    """While the model works on a batch, the load processes have loaded at
    most the batches queued for them ahead of it (64 records' worth per
    process, at least a batch each, at least 2), plus the one the prepare
    stage is handing over: never the whole job, however slow the model."""
    from load_job import LookAhead

    marks = tmp_path / "loaded"
    marks.mkdir()
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "x": i, "dir": str(marks)}) + "\n" for i in range(400)))
    report = stoke.torch_batch_process(LookAhead, {"dataset": {"format": "jsonl", "uri": str(path), "id_column": "id"},
                                                   "processor": {}}, batch_size=16, root=tmp_path / "root",
                                       device="cpu", load_workers=load_workers)
    rows = outputs(report, ("x", "lead"))
    assert sorted(rows) == sorted(f"r{i}" for i in range(400))
    assert all(rid == f"r{x}" for rid, (x, _) in rows.items())
    # The batch being processed, the batches waiting (64 records' worth
    # per load process: 4 batches of 16 each, at least 2) and the one the
    # prepare stage holds.
    bound = (1 + max(load_workers * 4, 2) + 1) * 16
    leads = [lead for _, lead in rows.values()]
    assert max(leads) <= bound, (max(leads), bound)
    # The first batch waited: the load processes did run ahead.
    assert rows["r0"][1] > 16, rows["r0"]


@pytest.mark.parametrize("load_workers", [1, 2])
def test_the_next_shards_records_are_loaded_before_this_shard_ends(tmp_path, load_workers):
    """The load processes do not drain at each shard's end: the next
    shard's batches go to them while this shard's last ones are processed
    and committed. Each shard's last checkpoint notes how many records
    beyond the processed ones were loaded (see ``AcrossShards``); before
    the job's last shard, records of a later shard were. Every record is
    committed once, in order."""
    from load_job import AcrossShards

    marks = tmp_path / "loaded"
    marks.mkdir()
    path = tmp_path / "data.jsonl"
    n = 240
    path.write_text("".join(json.dumps({"id": f"r{i:03d}", "x": i, "dir": str(marks)}) + "\n" for i in range(n)))
    report = stoke.torch_batch_process(AcrossShards, {"dataset": {"format": "jsonl", "uri": str(path), "id_column": "id"},
                                                      "processor": {"params": {"records": n}},
                                                      "sharding": {"bytes": "2KiB"}},
                                       batch_size=4, root=tmp_path / "root", device="cpu", load_workers=load_workers)
    rows = outputs(report, ("x",))
    assert sorted(rows) == [f"r{i:03d}" for i in range(n)]
    assert all(rid == f"r{x:03d}" for rid, (x,) in rows.items())
    leads = {p.name.removeprefix("lead-"): int(p.read_text()) for p in marks.glob("lead-*")}
    assert len(leads) >= 4, leads
    last = max(leads)
    # Each boundary's next shard is attached once its lease is taken,
    # which races with the model on this tiny workload; most boundaries
    # overlap, and none can without the feed across shards.
    overlapped = [shard for shard, lead in leads.items() if shard != last and lead > 0]
    assert overlapped, leads
    assert leads[last] == 0, leads
