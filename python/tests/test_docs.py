"""The book's Python code, run as printed: the code blocks are taken from
the book's pages themselves (docs/src/getting-started/python.md, "For
Python users", and docs/src/guide/results.md, "Finding and reading
results"), only the paths filled in (the data folder, the model file, the
coordinator's address), so a snippet that stops working as the book shows
it fails here."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

from conftest import DEADLINE, bin_path

BOOK = pathlib.Path(__file__).resolve().parents[2] / "docs" / "src"
# The pages whose code this file runs.
PYTHON_USERS = BOOK / "getting-started" / "python.md"
RESULTS = BOOK / "guide" / "results.md"


def blocks(page, lang):
    """The page's fenced code blocks in `lang`, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def block_starting(page, lang, first_line):
    for b in blocks(page, lang):
        if b.startswith(first_line):
            return b
    raise AssertionError(f"{page} has no ```{lang} block starting {first_line!r}")


def python_section(tmp_path, fixture_dir):
    """my_processor.py and job.toml as printed, in a folder of their own,
    with the data the spec names (`data/`) and the model path filled in."""
    processor = block_starting(PYTHON_USERS, "python", "# my_processor.py")
    spec = block_starting(PYTHON_USERS, "toml", "# job.toml")
    assert 'model = "file:///models/m.pt"' in spec, spec
    spec = spec.replace("file:///models/m.pt", f"file://{fixture_dir / 'model.pt'}")
    (tmp_path / "my_processor.py").write_text(processor)
    (tmp_path / "job.toml").write_text(spec)
    shutil.copytree(fixture_dir / "parquet", tmp_path / "data")
    return tmp_path


def run_python(code, cwd, env=None):
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_the_processor_and_torch_batch_process_as_printed(tmp_path, fixture_dir):
    folder = python_section(tmp_path, fixture_dir)
    snippet = block_starting(PYTHON_USERS, "python", "import stoke\n")
    # Its first part runs in process; the client part needs a cluster
    # (the next test).
    in_process = snippet.split("\n\n")[0]
    assert "torch_batch_process" in in_process, in_process
    out = run_python(f"import sys\nsys.path.insert(0, '.')\n{in_process}", folder)
    records, manifest = out.stdout.split()
    assert records == "3000", out.stdout
    manifest = json.loads(pathlib.Path(manifest.removeprefix("file://")).read_text())
    ids = [o for o in manifest["outputs"] if o["records"] > 0]
    assert sum(o["records"] for o in ids) == 3000
    # upload_path()'s files (none here: the example leaves `...`) would be
    # under _files/; the output folder reads as one table with pyarrow, as
    # the book's page on reading results says.
    output = pathlib.Path(manifest["outputs"][0]["uri"].removeprefix("file://")).parents[2]
    reading = block_starting(RESULTS, "python", "pyarrow.parquet.read_table")
    pyarrow_line = next(line for line in reading.splitlines() if line.startswith("pyarrow."))
    duckdb_line = next(line for line in reading.splitlines() if line.startswith("duckdb."))
    out = run_python(
        "import pyarrow.parquet, duckdb\n"
        f"t = {pyarrow_line.split('#')[0].strip()}\n"
        f"d = {duckdb_line.split('#')[0].strip()}.fetchall()\n"
        "print(t.num_rows, len(d))\n",
        output.parent,
    )
    assert out.stdout.split() == ["3000", "3000"], out.stdout


def test_the_client_as_printed(cluster, tmp_path, fixture_dir):
    folder = python_section(tmp_path, fixture_dir)
    snippet = block_starting(PYTHON_USERS, "python", "import stoke\n")
    client_part = snippet.split("\n\n", 1)[1]
    assert 'stoke.Client("coordinator:7070")' in client_part, client_part
    client_part = client_part.replace("coordinator:7070", cluster.address)
    # A worker that waits for the job the snippet submits.
    log = open(tmp_path / "worker-docs.log", "w")
    cluster.procs.append(subprocess.Popen(
        [str(bin_path("stoke-worker")), "--coordinator", cluster.address, "--worker-id", "docs",
         "--device", "cpu", "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT))
    out = run_python(
        "import sys\nsys.path.insert(0, '.')\nimport stoke\n" + textwrap.dedent(client_part),
        folder,
    )
    busy = float(out.stdout.strip().splitlines()[-1])
    assert 0.0 <= busy <= 1.0, out.stdout
