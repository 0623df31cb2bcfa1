#!/usr/bin/env bash
# The coordinator's state machine (coordinator/src/state/) decides without
# I/O (docs/src/adr/005-coordinator-decides-without-io.md): whatever it wants
# done leaves as an effect, and the time comes in as `now`. This fails when
# its code reaches for what only the owner (coordinator/src/owner/) may use:
# tokio's channels and locks, spawned tasks, `.await`, the clocks (the wall
# clock too, `stoke_core::records::now_ms`), the object stores or a store
# handle, the file system.
#
# Types stay fine: `tokio::time::Instant` (what `now` is; tests pause it),
# `StoreUri`, `StoreError`, pure helpers such as `to_json_bytes`. Comments
# and string literals are not looked at, nor a file's trailing
# `#[cfg(test)] mod tests` (clippy's `items_after_test_module` keeps it last):
# a unit test may make its own `Instant`.
#
#   scripts/check-state-pure.sh [DIR]    # DIR: coordinator/src/state by default
set -euo pipefail

dir="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/coordinator/src/state}"
[ -d "$dir" ] || {
  echo "check-state-pure: no folder $dir" >&2
  exit 2
}

python3 - "$dir" <<'EOF'
import pathlib
import re
import sys

# (pattern, what it is): each is something only the owner does.
FORBIDDEN = [
    (r"\btokio::sync\b|\btokio::\{[^}]*\bsync\b", "tokio::sync (channels, locks)"),
    (r"\btokio::spawn\b|\bspawn_blocking\b|\btokio::task\b", "a spawned task"),
    (r"\.await\b|\basync\s+(fn|move|\{)", "async code (.await)"),
    (r"\bInstant::now\b", "Instant::now (take `now` as a parameter)"),
    (r"\bSystemTime::now\b|\bUtc::now\b|\bnow_ms\s*\(", "the wall clock"),
    (r"\bobject_store\b", "object_store"),
    (r"\bStores\b", "a store handle (Stores): its I/O is the owner's"),
    (r"\bstd::fs\b|\btokio::fs\b", "the file system"),
]

STRING = re.compile(r'r(#*)"(?:.|\n)*?"\1|b?"(?:\\.|[^"\\])*"', re.S)
CHAR = re.compile(r"b?'(?:\\.|[^\\'\n])'")
BLOCK = re.compile(r"/\*.*?\*/", re.S)
LINE = re.compile(r"//[^\n]*")
TESTS = re.compile(r"^#\[cfg\(test\)\]\s*\n\s*mod\s+\w+\s*\{", re.M)


def blank(match):
    # Keeps the line count, so the line numbers reported stay right.
    return re.sub(r"[^\n]", " ", match.group(0))


def code_of(text):
    tests = TESTS.search(text)
    if tests:
        text = text[: tests.start()]
    out, i = [], 0
    # One pass left to right, so a `//` inside a string is not a comment
    # and a quote inside a comment starts no string.
    token = re.compile("|".join(f"(?:{p.pattern})" for p in (STRING, CHAR, BLOCK, LINE)), re.S)
    for m in token.finditer(text):
        out.append(text[i : m.start()])
        out.append(blank(m))
        i = m.end()
    out.append(text[i:])
    return "".join(out)


root = pathlib.Path(sys.argv[1])
found = []
for path in sorted(root.rglob("*.rs")):
    code = code_of(path.read_text())
    for pattern, what in FORBIDDEN:
        for m in re.finditer(pattern, code):
            line = code.count("\n", 0, m.start()) + 1
            found.append(f"{path}:{line}: {what}: `{m.group(0)}`")
if found:
    print("coordinator/src/state/ must decide without I/O (ADR 005); found:", file=sys.stderr)
    for f in found:
        print(f"  {f}", file=sys.stderr)
    print("make it an effect (state/effects.rs) the owner runs, or take `now` as a parameter", file=sys.stderr)
    sys.exit(1)
print(f"state is pure: {sum(1 for _ in root.rglob('*.rs'))} files checked")
EOF
