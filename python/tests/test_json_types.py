"""JSON numbers as PyTorch users expect them (issue 45): JSON Lines floats
reach a Python processor as torch's default dtype, integers as int64;
``[dataset.types]`` states a column's type over what inference suggests
(float64 kept, the id-column trap fixed by "string"); mistakes are refused
at submit, naming them; the same through ``torch_batch_process`` over a
spec, local worker processes, and ``Client``-submitted jobs."""

import json
import pathlib
import random
import sys

import pyarrow.parquet as pq
import pytest
import torch

import stoke

PROCESSORS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"
# The processor's module, for the in-process runs.
sys.path.insert(0, str(PROCESSORS))
RECORDS = 240
# The first lines' user ids look like numbers; the last 40 are not.
NUMERIC_IDS = 200


@pytest.fixture
def data(tmp_path):
    """records.jsonl, a float32 TorchScript model, and torch's reference."""
    rng = random.Random(45)
    rows = []
    for i in range(RECORDS):
        rows.append({
            "id": f"r{i:03}",
            "features": [round(rng.uniform(-2, 2), 6) for _ in range(16)],
            "ragged": [rng.random() for _ in range(1 + i % 5)],
            "user_id": 100000 + i if i < NUMERIC_IDS else f"u{i}x",
            "score": rng.random(),
            "count": i,
        })
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.manual_seed(45)
    model = torch.jit.script(torch.nn.Linear(16, 4))
    model_path = tmp_path / "model.pt"
    model.save(str(model_path))
    with torch.no_grad():
        x = torch.tensor([r["features"] for r in rows])  # the default dtype, as a user writes it
        reference = {r["id"]: s for r, s in zip(rows, model(x).tolist())}
    return {"path": path, "model": model_path, "rows": rows, "reference": reference}


def spec(data, types=None, policy="fail"):
    dataset = {"format": "jsonl", "uri": str(data["path"]), "id_column": "id"}
    if types:
        dataset["types"] = types
    return {
        "dataset": dataset,
        "processor": {"python": "json_types_job:Predict", "python_path": [str(PROCESSORS)],
                      "params": {"model": str(data["model"])}},
        "batching": {"batch_size": 32},
        "sharding": {"records": 100},
        "errors": {"policy": policy},
    }


def outputs(report):
    rows = {}
    for o in report["outputs"]:
        for row in pq.read_table(o["uri"].removeprefix("file://")).to_pylist():
            assert row["id"] not in rows, f"{row['id']} committed twice"
            rows[row["id"]] = row
    return rows


def run(data, tmp_path, job_id, **kwargs):
    from json_types_job import Predict

    s = kwargs.pop("spec", None) or spec(data)
    return stoke.torch_batch_process(Predict, s, root=tmp_path / "root", job_id=job_id, device="cpu", **kwargs)


def check_predictions(rows, data, ids):
    assert sorted(rows) == sorted(ids)
    for rid in ids:
        got, want = rows[rid]["scores"], data["reference"][rid]
        assert got == pytest.approx(want, abs=1e-5), rid


def test_json_floats_reach_python_as_the_default_dtype_and_a_float32_model_runs(data, tmp_path):
    report = run(data, tmp_path, "floats", spec=spec(data, types={"user_id": "string"}))
    rows = outputs(report)
    check_predictions(rows, data, [r["id"] for r in data["rows"]])
    for row in rows.values():
        assert row["features_dtype"] == "torch.float32", row
        assert row["ragged_dtype"] == "list of torch.float32", row
        assert row["padded_dtype"] == "torch.float32", row
        assert row["score_dtype"] == "torch.float32", row
        assert row["count_dtype"] == "torch.int64", row


def test_stated_float64_stays_float64(data, tmp_path):
    s = spec(data, types={"user_id": "string", "features": "list<float64>", "score": "float64"})
    s["processor"]["params"]["cast"] = True
    rows = outputs(run(data, tmp_path, "f64", spec=s))
    check_predictions(rows, data, [r["id"] for r in data["rows"]])
    for row in rows.values():
        assert row["features_dtype"] == "torch.float64", row
        assert row["score_dtype"] == "torch.float64", row
        # Not stated: the default dtype still.
        assert row["ragged_dtype"] == "list of torch.float32", row


def test_the_id_column_trap_is_fixed_by_string(data, tmp_path):
    # Inferred: most lines' user ids are numbers, so the others are bad records.
    trapped = run(data, tmp_path, "trap", spec=spec(data, policy="skip"))
    assert trapped["records_skipped"] == RECORDS - NUMERIC_IDS
    # Stated a string: every record, the numeric ids as their text.
    fixed = run(data, tmp_path, "fixed", spec=spec(data, types={"user_id": "string"}, policy="skip"))
    assert fixed["records_skipped"] == 0
    rows = outputs(fixed)
    assert rows["r000"]["user_id"] == "100000"
    assert rows["r239"]["user_id"] == "u239x"
    # A value that does not fit its stated type is a bad record, named.
    stated = run(data, tmp_path, "stated", spec=spec(data, types={"user_id": "int64"}, policy="skip"))
    assert stated["records_skipped"] == RECORDS - NUMERIC_IDS
    errors = [json.loads(line) for e in json.loads((tmp_path / "root" / "jobs" / "stated" / "manifest.json")
                                                   .read_text())["errors"]
              for line in pathlib.Path(e["uri"].removeprefix("file://")).read_text().splitlines()]
    assert len(errors) == RECORDS - NUMERIC_IDS
    assert all("stated in [dataset.types]" in e["reason"] for e in errors), errors[0]


@pytest.mark.parametrize("types,message", [
    ({"features": "list<flaot32>"}, 'dataset.types.features: unknown type "flaot32"'),
    ({"nope": "string"}, '[dataset.types] names column "nope", which is not in'),
])
def test_mistakes_are_refused_at_submit_naming_them(data, tmp_path, types, message):
    with pytest.raises(stoke.StokeError) as e:
        run(data, tmp_path, "bad", spec=spec(data, types=types))
    assert message in str(e.value), str(e.value)
    assert not (tmp_path / "root" / "jobs" / "bad" / "plan.json").exists()


def test_types_on_parquet_are_refused_and_parquet_float64_stays(data, tmp_path):
    import pyarrow as pa

    rows = data["rows"]
    table = pa.table({
        "id": [r["id"] for r in rows],
        "features": pa.array([r["features"] for r in rows], type=pa.list_(pa.float64(), 16)),
        "ragged": [r["ragged"] for r in rows],
        "user_id": [str(r["user_id"]) for r in rows],
        "score": [r["score"] for r in rows],
        "count": [r["count"] for r in rows],
    })
    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(table, folder / "part-0.parquet")
    s = spec(data)
    s["dataset"] = {"format": "parquet", "uri": str(folder) + "/", "id_column": "id", "types": {"score": "float32"}}
    with pytest.raises(stoke.StokeError, match='dataset.types: only for format "jsonl", not "parquet"'):
        run(data, tmp_path, "pq-types", spec=s)
    del s["dataset"]["types"]
    s["processor"]["params"]["cast"] = True
    rows = outputs(run(data, tmp_path, "pq", spec=s))
    check_predictions(rows, data, [r["id"] for r in data["rows"]])
    for row in rows.values():
        assert row["features_dtype"] == "torch.float64", row
        assert row["score_dtype"] == "torch.float64", row


def test_the_same_on_local_workers_and_through_client(data, tmp_path, cluster):
    report = run(data, tmp_path / "local", "workers", spec=spec(data, types={"user_id": "string"}), workers=2)
    rows = outputs(report)
    check_predictions(rows, data, [r["id"] for r in data["rows"]])
    assert {r["features_dtype"] for r in rows.values()} == {"torch.float32"}

    client = stoke.Client(cluster.address)
    job = client.submit(spec(data, types={"user_id": "string"}))
    cluster.worker()
    last = list(client.watch(job["job_id"], poll=0.05))[-1]
    assert last["state"] == "succeeded", last
    manifest = json.loads(pathlib.Path(last["manifest_uri"].removeprefix("file://")).read_text())
    got = outputs(manifest)
    check_predictions(got, data, [r["id"] for r in data["rows"]])
    assert {r["features_dtype"] for r in got.values()} == {"torch.float32"}
