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


def outputs(report):
    out = {}
    for o in report["outputs"]:
        t = pq.read_table(o["uri"].removeprefix("file://")).to_pydict()
        for i, rid in enumerate(t["id"]):
            assert rid not in out, f"{rid} twice"
            out[rid] = (t["x"][i], t["square"][i], t["pid"][i])
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
    got = {}
    for o in report["outputs"]:
        t = pq.read_table(o["uri"].removeprefix("file://")).to_pydict()
        for i, rid in enumerate(t["id"]):
            got[rid] = (t["first"][i], t["length"][i], t["token_sum"][i])
    assert len(got) == 100
    for i in range(100):
        n = i % 5 + 1
        assert got[f"r{i}"] == (pytest.approx(float(i)), n, n * (n - 1) // 2)
