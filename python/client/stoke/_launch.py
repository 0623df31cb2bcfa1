"""The commands of a pip install: ``stoke``, ``stoke-coordinator`` (the
``stoke-client`` distribution) and ``stoke-worker`` (the ``stoke``
distribution). Each replaces this Python process (``exec``: same process id,
so signals from a shell, a supervisor or Kubernetes reach the binary) with
the binary of the same name bundled in this package's ``bin/`` folder: the
same Rust code, built by the same ``cargo build --release``, as the
binaries ``cargo install`` gives. ``stoke run --embedded`` and ``stoke run
--local`` find ``stoke-embedded`` and ``stoke-worker`` next to ``stoke``
there, as they do in a cargo build folder.

Why a launcher rather than the binaries themselves on PATH: ``stoke-worker``
and ``stoke-embedded`` link libtorch and libpython, and where those are
depends on the Python this package is installed for, not on anything known
when the wheel is built:

- libtorch is the torch wheel's ``torch/lib``. The binaries carry the rpath
  ``$ORIGIN/../../torch/lib``, which holds whenever torch and stoke sit in
  one ``site-packages`` (a venv, a user or system install); when torch is
  elsewhere (``--system-site-packages``), its folder is found here, without
  importing torch, and put on ``LD_LIBRARY_PATH``.
- libpython (the worker embeds CPython for Python processors) is in this
  interpreter's ``LIBDIR`` (pyenv, python.org builds, the ``python`` images)
  or in the system's library folders (Debian's ``libpython3.X`` package).
  ``LIBDIR`` goes on ``LD_LIBRARY_PATH`` when the library is there.
- The Python that Python processors run in is this one:
  ``STOKE_DEFAULT_PYTHON`` is ``sys.executable`` (a cargo build defaults to
  the venv it was built against, which does not exist on the machine a
  wheel lands on). ``STOKE_PYTHON``, which a worker checks when it starts
  (a Python start, about 45 ms of CPU), still wins when the user sets it;
  this default is checked when a Python processor first runs.

This module imports nothing beyond the standard library (and ``import
stoke`` is lazy), so a command costs one Python start-up before the binary
runs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")

# The binaries that link libtorch and libpython, and the distribution each
# command comes from (for the message when it is missing).
_LINKS_TORCH = {"stoke-worker", "stoke-embedded"}
_DISTRIBUTION = {
    "stoke": "stoke-client",
    "stoke-coordinator": "stoke-client",
    "stoke-worker": "stoke",
    "stoke-embedded": "stoke",
}


def _prepend(env: dict, var: str, folder: str) -> None:
    parts = [p for p in env.get(var, "").split(os.pathsep) if p]
    if folder not in parts:
        env[var] = os.pathsep.join([folder, *parts])


def _system_library_folders() -> set[str]:
    """The folders the dynamic loader searches by itself: its defaults
    and those /etc/ld.so.conf.d names (ldconfig's cache)."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    folders = {"/lib", "/usr/lib", "/lib64", "/usr/lib64"}
    if multiarch:
        folders |= {f"/lib/{multiarch}", f"/usr/lib/{multiarch}"}
    try:
        confs = [os.path.join("/etc/ld.so.conf.d", n) for n in os.listdir("/etc/ld.so.conf.d")]
    except OSError:
        confs = []
    for conf in confs:
        try:
            with open(conf) as f:
                folders |= {line.strip() for line in f if line.strip().startswith("/")}
        except OSError:
            pass
    return {os.path.normpath(f) for f in folders}


def _libpython_folder() -> str | None:
    """The folder of this interpreter's shared libpython, when the loader
    would not find it by itself (pyenv, a python.org build in a prefix of
    its own); None when it needs no help."""
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    if not soname or not libdir or not os.path.exists(os.path.join(libdir, soname)):
        return None
    if os.path.normpath(libdir) in _system_library_folders():
        return None
    return libdir


def _has_libpython() -> bool:
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    if not soname:
        return True
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    folders = [libdir, os.path.join(libdir, multiarch), f"/usr/lib/{multiarch}", f"/lib/{multiarch}", "/usr/local/lib", "/usr/lib"]
    folders += os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)
    return any(f and os.path.exists(os.path.join(f, soname)) for f in folders)


def _torch_lib_elsewhere() -> str | None:
    """torch's ``lib`` folder when it is not beside this package (the
    binaries' rpath); None when the rpath finds it, or torch is absent."""
    beside = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torch", "lib")
    if os.path.isdir(beside):
        return None
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = os.path.join(list(spec.submodule_search_locations)[0], "lib")
    return lib if os.path.isdir(lib) else None


def environment(env: dict | None = None) -> dict:
    """The environment the bundled binaries run with (``env`` changed in
    place, ``os.environ`` by default): what ``stoke-worker`` and
    ``stoke-embedded`` need, set for the ``stoke`` command too, since it
    starts them (``stoke run``)."""
    env = os.environ if env is None else env
    env["STOKE_DEFAULT_PYTHON"] = sys.executable
    libpython = _libpython_folder()
    if libpython:
        _prepend(env, "LD_LIBRARY_PATH", libpython)
    torch_lib = _torch_lib_elsewhere()
    if torch_lib:
        _prepend(env, "LD_LIBRARY_PATH", torch_lib)
    return env


def binary(name: str) -> str:
    """The path of the bundled binary ``name``."""
    return os.path.join(_BIN, name)


def _exec(name: str) -> None:
    path = binary(name)
    if not os.access(path, os.X_OK):
        dist = _DISTRIBUTION.get(name, "stoke")
        sys.stderr.write(
            f"{name}: this install has no bundled {name} ({path}); it comes with the "
            f"`{dist}` distribution's release wheel (a development build of the package, "
            f"scripts/python-package.sh without --release, bundles none: use the cargo-built "
            f"binaries, target/debug/{name})\n"
        )
        sys.exit(127)
    if name in _LINKS_TORCH and not _has_libpython():
        soname = sysconfig.get_config_var("INSTSONAME")
        version = sysconfig.get_python_version()
        sys.stderr.write(
            f"{name}: this Python ({sys.executable}) has no shared library {soname}, which {name} "
            f"links (it embeds CPython for Python processors); on Debian and Ubuntu: "
            f"apt-get install libpython{version}\n"
        )
        sys.exit(127)
    environment()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, [name, *sys.argv[1:]])


def stoke() -> None:
    """The ``stoke`` command."""
    _exec("stoke")


def coordinator() -> None:
    """The ``stoke-coordinator`` command."""
    _exec("stoke-coordinator")


def worker() -> None:
    """The ``stoke-worker`` command."""
    _exec("stoke-worker")
