"""stoke.torch_batch_process: a job in this Python process, with the
processor class given; the same outputs as `stoke run --embedded`."""

import json
import pathlib
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import stoke
from conftest import bin_path, fixture_spec

PROCESSORS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"


def rows(report_or_manifest_uri):
    manifest_path = report_or_manifest_uri.removeprefix("file://")
    manifest = json.loads(pathlib.Path(manifest_path).read_text())
    out = {}
    for entry in manifest["outputs"]:
        if entry["records"] == 0:
            continue
        t = pq.read_table(entry["uri"].removeprefix("file://")).to_pydict()
        for i, rid in enumerate(t["id"]):
            assert rid not in out, f"{rid} twice"
            out[rid] = (t["prediction"][i], t["scores"][i])
    return out


def test_torch_batch_process_equals_run_embedded(fixture_dir, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(PROCESSORS)!r})\n"
        "import stoke\n"
        "from processors import Runner\n"
        f"spec = json.loads({json.dumps(json.dumps(fixture_spec(fixture_dir)))})\n"
        f"report = stoke.torch_batch_process(Runner, spec, root={str(tmp_path / 'py-root')!r}, batch_size=50)\n"
        "print(json.dumps(report))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["records"] == 3000
    assert report["manifest_uri"].endswith("manifest.json")
    py_rows = rows(report["manifest_uri"])

    spec_path = tmp_path / "job.json"
    spec_path.write_text(json.dumps(fixture_spec(fixture_dir)))
    root = tmp_path / "cli-root"
    cli = subprocess.run(
        [str(bin_path("stoke")), "run", str(spec_path), "--embedded", "--device", "cpu", "--threads", "1", "--root", str(root)],
        capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    job = [l.split(":", 1)[1].strip() for l in cli.stdout.splitlines() if l.strip().startswith("job:")][0]
    cli_rows = rows(str(root / "jobs" / job / "manifest.json"))
    assert len(py_rows) == 3000
    assert py_rows.keys() == cli_rows.keys()
    for rid, (pred, scores) in cli_rows.items():
        assert py_rows[rid][0] == pred, rid
        assert py_rows[rid][1] == pytest.approx(scores, rel=1e-5, abs=1e-6), rid


def test_a_failing_job_raises_stoke_error(fixture_dir, tmp_path):
    sys.path.insert(0, str(PROCESSORS))
    from processors import Runner

    spec = fixture_spec(fixture_dir)
    spec["processor"]["params"]["fail_batch"] = ["s00000", 0]
    with pytest.raises(stoke.StokeError, match="boom on purpose"):
        stoke.torch_batch_process(Runner, spec, root=str(tmp_path / "root"))


def test_a_class_that_is_not_a_processor_is_refused(fixture_dir, tmp_path):
    class Plain:
        pass

    with pytest.raises(TypeError, match="TorchBatchProcessor"):
        stoke.torch_batch_process(Plain, fixture_spec(fixture_dir), root=str(tmp_path))
