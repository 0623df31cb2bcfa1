"""The commands of the ``stoke-client`` distribution, ``stoke`` and
``stoke-coordinator``: each replaces this Python process (``exec``: same
process id, so signals from a shell, a supervisor or Kubernetes reach the
binary) with the binary of the same name bundled in this package's
``bin/`` folder: the same Rust code, built by the same ``cargo build
--release``, as the binaries ``cargo install`` gives. Neither links
libtorch or libpython.

The ``stoke`` distribution adds ``stoke-worker`` (``stoke._worker``: the
worker runs in the Python the package is installed for, through the
compiled ``stoke._native``) and, in ``bin/``, the ``stoke-worker`` and
``stoke-embedded`` that ``stoke run --local`` and ``stoke run --embedded``
find beside ``stoke``, as in a cargo build folder: small scripts that start
``python -m stoke._worker`` and ``python -m stoke._embedded``. The Python
they start is this one: ``STOKE_DEFAULT_PYTHON`` is ``sys.executable``.
``STOKE_PYTHON``, which a worker checks when it starts (a Python start,
about 45 ms of CPU), still wins for Python processors when the user sets
it.

This module imports nothing beyond the standard library (and ``import
stoke`` is lazy), so a command costs one Python start-up before the binary
runs.
"""

from __future__ import annotations

import os
import sys

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")


def environment(env: dict | None = None) -> dict:
    """The environment the bundled binaries run with (``env`` changed in
    place, ``os.environ`` by default): the Python that the workers and
    embedded mode they start (``stoke run``) run in."""
    env = os.environ if env is None else env
    env["STOKE_DEFAULT_PYTHON"] = sys.executable
    return env


def binary(name: str) -> str:
    """The path of the bundled binary ``name``."""
    return os.path.join(_BIN, name)


def _exec(name: str) -> None:
    path = binary(name)
    if not os.access(path, os.X_OK):
        sys.stderr.write(
            f"{name}: this install has no bundled {name} ({path}); it comes with the "
            f"`stoke-client` distribution's release wheel (a development build of the package, "
            f"scripts/python-package.sh without --release, bundles none: use the cargo-built "
            f"binaries, target/debug/{name})\n"
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
