"""Imported last in the preload of a fork server started ahead of its
job: waits for the worker's word of what else to import before the
server forks anything (see ``stoke._fork_word``).

Not a public module.
"""

from stoke import _fork_word

try:
    _fork_word.wait()
except Exception:  # noqa: BLE001 (a server that cannot wait serves as one started late)
    pass
