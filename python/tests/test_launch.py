"""The commands of a pip install: `stoke` and `stoke-coordinator`
(launchers, stoke/_launch.py, that exec the bundled binary) and the worker
run in this Python (`stoke-worker`, `python -m stoke._worker`, and the
scripts in stoke/bin/ that `stoke run` finds beside `stoke`), which must
start as the cargo-built binary does. The release wheels themselves are
tested end to end by scripts/wheel-test.sh."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

from conftest import wait_for

import stoke
from stoke import _launch

# Runs a launcher entry point with its bin folder replaced by argv[1].
RUN = """
import sys
from stoke import _launch
_launch._BIN = sys.argv[1]
sys.argv = [sys.argv[2], *sys.argv[3:]]
getattr(_launch, sys.argv[0].replace("stoke-", "") if sys.argv[0] != "stoke" else "stoke")()
"""


def _fake_binary(folder, name):
    path = folder / name
    path.write_text('#!/bin/sh\necho "argv0=$0 args=$* python=$STOKE_DEFAULT_PYTHON pid=$$"\n')
    path.chmod(0o755)
    return path


def test_the_environment_names_this_python_and_leaves_stoke_python_alone():
    env = _launch.environment({})
    assert env["STOKE_DEFAULT_PYTHON"] == sys.executable
    assert "STOKE_PYTHON" not in env
    given = _launch.environment({"STOKE_PYTHON": "/opt/py/bin/python"})
    assert given["STOKE_PYTHON"] == "/opt/py/bin/python"


def test_a_command_execs_its_binary_with_its_arguments(tmp_path):
    _fake_binary(tmp_path, "stoke-coordinator")
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path), "stoke-coordinator", "--listen", "h:7070"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "STOKE_PYTHON"},
        check=True,
    )
    line = out.stdout.strip()
    assert f"argv0={tmp_path}/stoke-coordinator" in line
    assert "args=--listen h:7070" in line
    assert f"python={sys.executable}" in line


def test_a_missing_binary_says_where_it_comes_from(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path), "stoke-coordinator", "--help"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 127
    assert "no bundled stoke-coordinator" in out.stderr
    assert "stoke-client" in out.stderr


def test_import_stoke_imports_neither_torch_nor_the_compiled_modules():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, stoke, stoke._launch; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'pyarrow') or m.startswith('stoke._native')))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_the_public_names_resolve():
    for name in stoke.__all__:
        assert getattr(stoke, name) is not None, name
    assert issubclass(stoke.JobPaused, stoke.StokeError)


STOKE_BIN = os.path.join(os.path.dirname(stoke.__file__), "bin")


def test_the_scripts_beside_stoke_start_the_worker_and_embedded_mode_in_this_python():
    env = {k: v for k, v in os.environ.items() if k not in ("STOKE_DEFAULT_PYTHON", "STOKE_PYTHON")}
    for name in ("stoke-worker", "stoke-embedded"):
        script = os.path.join(STOKE_BIN, name)
        # Named by the `stoke` launcher, or found from the script's own
        # place (<prefix>/lib/python3.X/site-packages/stoke/bin).
        for given in ({"STOKE_DEFAULT_PYTHON": sys.executable}, {}):
            out = subprocess.run([script, "--version"], capture_output=True, text=True, env={**env, **given})
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == f"{name} {stoke.__version__}", out.stdout


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hosted_worker(extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(extra_env)
    return subprocess.Popen(
        [sys.executable, "-m", "stoke._worker", "--coordinator", f"http://127.0.0.1:{_closed_port()}", "--device", "cpu"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _blocked(pid, sig):
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return False
    mask = re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.M)
    return bool(mask) and int(mask.group(1), 16) & (1 << (sig - 1)) != 0


def test_a_worker_in_python_starts_as_the_binary_does():
    # libgomp shows the settings it loaded with: the OpenMP wait settings,
    # in place before libtorch loaded, so the worker did not run itself
    # again (one display, one start).
    worker = _hosted_worker({"OMP_DISPLAY_ENV": "verbose"})
    try:
        lines = []
        wait_for("the worker to try the coordinator", lambda: (lines.append(worker.stderr.readline()) or "cannot reach the coordinator" in lines[-1]), 60)
        with open(f"/proc/{worker.pid}/comm") as f:
            assert f.read().strip() == "stoke-worker"
        log = "".join(lines)
        assert log.count("OPENMP DISPLAY ENVIRONMENT BEGIN") == 1, log
        assert "OMP_WAIT_POLICY = 'PASSIVE'" in log, log
        assert "GOMP_SPINCOUNT = '10000'" in log, log
        # Listening for stop signals now: SIGTERM stops it cleanly.
        assert not _blocked(worker.pid, signal.SIGTERM)
        worker.send_signal(signal.SIGTERM)
        rest = worker.communicate(timeout=60)[1]
        assert worker.returncode == 0, rest
        assert "worker stopped" in rest, rest
    finally:
        worker.kill()


def test_sigterm_while_a_worker_in_python_starts_stops_it_cleanly():
    worker = _hosted_worker({})
    try:
        # Blocked from before stoke._native loads libtorch.
        end = time.monotonic() + 60
        while not _blocked(worker.pid, signal.SIGTERM):
            assert worker.poll() is None and time.monotonic() < end, "SIGTERM never blocked"
        worker.send_signal(signal.SIGTERM)
        log = worker.communicate(timeout=60)[1]
        assert worker.returncode == 0, log
        assert "signal received during start-up: stopping before taking any lease" in log, log
    finally:
        worker.kill()


# Workers in Python (`python -m stoke._worker`, no `import torch` before
# the worker starts) running a processor that sets an attribute of a
# TorchScript module: torch's pybind11 then re-takes the GIL on the thread
# that imported torch, which must keep its Python thread state
# (worker/src/python/interp.rs, keep_thread_state); it died of a
# segmentation fault before.
JIT_SCRIPT = '''
import json, sys, torch
from torch.utils.data import Dataset
from stoke import TorchBatchProcessor, torch_batch_process

class Pairs(Dataset):
    def __len__(self):
        return 200
    def __getitem__(self, i):
        return torch.tensor([float(i), 1.0]), i

class JitProcessor(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
        model = torch.jit.script(torch.nn.Linear(2, 1))
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[2.0, 3.0]]))
            model.bias.zero_()
        model.training = False
        self.model = model
    def process_batch(self, batch, batch_idx):
        with torch.no_grad():
            y = self.model(batch[0]).squeeze(1)
        self.context.write_rows({"id": batch.ids, "y": y})

report = torch_batch_process(JitProcessor, Pairs(), root=sys.argv[1], batch_size=16, workers=2,
                             job_id="jit", shard_records=50, device="cpu")
print(json.dumps(report))
'''


def test_workers_in_python_run_a_torchscript_processor(tmp_path):
    import pyarrow.dataset as ds

    script = tmp_path / "jit_job.py"
    script.write_text(JIT_SCRIPT)
    root = tmp_path / "root"
    out = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    table = ds.dataset(str(root / "jobs" / "jit" / "outputs"), format="parquet").to_table()
    got = dict(zip(table.column("id").to_pylist(), table.column("y").to_pylist()))
    assert sorted(got, key=int) == [str(i) for i in range(200)]
    assert all(got[str(i)] == 2.0 * i + 3.0 for i in range(200))
