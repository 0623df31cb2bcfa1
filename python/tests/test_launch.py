"""The commands' launchers (stoke/_launch.py): what a pip install's
`stoke`, `stoke-coordinator` and `stoke-worker` run before the bundled
binary. The release wheels themselves are tested end to end by
scripts/wheel-test.sh."""

import os
import subprocess
import sys
import sysconfig

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


def test_libpython_goes_on_the_library_path_only_from_its_own_folder():
    env = _launch.environment({"LD_LIBRARY_PATH": "/already/there"})
    soname = sysconfig.get_config_var("INSTSONAME")
    libdir = sysconfig.get_config_var("LIBDIR")
    parts = env["LD_LIBRARY_PATH"].split(os.pathsep)
    assert parts[-1] == "/already/there"
    if os.path.exists(os.path.join(libdir, soname)) and os.path.normpath(libdir) not in _launch._system_library_folders():
        # First, or after torch's lib when torch is not beside stoke.
        assert libdir in parts[:-1]
        # Not twice.
        again = _launch.environment(dict(env))
        assert again["LD_LIBRARY_PATH"] == env["LD_LIBRARY_PATH"]
    else:
        assert libdir not in parts


def test_a_command_execs_its_binary_with_its_arguments(tmp_path):
    _fake_binary(tmp_path, "stoke-worker")
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path), "stoke-worker", "--coordinator", "http://h:7070"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "STOKE_PYTHON"},
        check=True,
    )
    line = out.stdout.strip()
    assert f"argv0={tmp_path}/stoke-worker" in line
    assert "args=--coordinator http://h:7070" in line
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
