"""``stoke-embedded`` in a Python process: ``python -m stoke._embedded
SPEC --root ROOT ...`` runs a job in this one process (what ``stoke run
--embedded`` hands over to in a pip install), Python processors in this
interpreter; exits with the ``stoke`` command's exit codes."""

import sys

from . import _host


def main() -> None:
    _host.prepare()
    from . import _native

    _native.embedded_main(["stoke-embedded", *sys.argv[1:]])


if __name__ == "__main__":
    main()
