"""Fixtures for the stoke package's tests: real coordinator and worker
processes (binaries from $STOKE_BIN_DIR) and the shared test data
($STOKE_TEST_FIXTURE, written by scripts/test_fixture.py)."""

import os
import pathlib
import subprocess
import sys
import time

import pytest

DEADLINE = 120.0


def wait_for(what, predicate, deadline=DEADLINE):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def bin_path(name):
    bin_dir = pathlib.Path(os.environ.get("STOKE_BIN_DIR", ""))
    path = bin_dir / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build the binaries (cargo build --workspace --bins) and set STOKE_BIN_DIR")
    return path


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory):
    given = os.environ.get("STOKE_TEST_FIXTURE")
    if given:
        return pathlib.Path(given)
    out = tmp_path_factory.mktemp("fixture")
    repo = pathlib.Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(repo / "scripts/test_fixture.py"), str(out)], check=True)
    return out


class Cluster:
    def __init__(self, tmp, env=None):
        """A coordinator on loopback; `env` adds to the environment of it
        and its workers (tokens, say)."""
        self.tmp = tmp
        self.env = {**os.environ, **(env or {})}
        self.root = tmp / "root"
        addr_file = tmp / "coordinator.addr"
        self.log = open(tmp / "coordinator.log", "w")
        self.procs = [subprocess.Popen(
            [str(bin_path("stoke-coordinator")), "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0",
             "--root", str(self.root), "--addr-file", str(addr_file)],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env)]
        self.address = "http://" + wait_for("the coordinator's address", lambda: addr_file.exists() and addr_file.read_text().strip())

    def worker(self, name="w1"):
        log = open(self.tmp / f"worker-{name}.log", "w")
        proc = subprocess.Popen(
            [str(bin_path("stoke-worker")), "--coordinator", self.address, "--worker-id", name,
             "--device", "cpu", "--threads", "1", "--exit-when-idle"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append(proc)
        return proc

    def close(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.kill()
            p.wait()
        self.log.close()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def fixture_spec(fixture_dir, processors_dir=None, **extra):
    """The fixture job as a dict: the built-in runner, or (with
    processors_dir) tests/python/processors.py:Runner."""
    processor = {
        "params": {"model": f"file://{fixture_dir / 'model.pt'}", "input_column": "features", "outputs": ["argmax", "scores"]},
    }
    if processors_dir is None:
        processor["name"] = "torchscript"
    else:
        processor["python"] = "processors:Runner"
        processor["python_path"] = [str(processors_dir)]
    spec = {
        "name": "pyfixture",
        "max_attempts": 2,
        "dataset": {"format": "parquet", "uri": f"file://{fixture_dir / 'parquet'}/", "id_column": "id"},
        "processor": processor,
        "batching": {"batch_size": 50},
        "checkpoint": {"interval": 3},
        "sharding": {"records": 400},
    }
    spec.update(extra)
    return spec
