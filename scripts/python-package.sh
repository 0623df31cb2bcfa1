#!/usr/bin/env bash
# Builds the stoke Python distributions (maturin, PyO3) and installs them
# into the stoke venv; idempotent and cached: wheels are built only when the
# sources they are made from change (keyed on their hash and the profile),
# and kept in ~/.cache/stoke/wheels. Also installs the build and test tools
# it needs (maturin, pytest) into the venv, once.
#
#   scripts/python-package.sh                     # dev build (the tests'), install
#   scripts/python-package.sh --release           # the release build, what users install
#   scripts/python-package.sh --release --wheel   # ... and print the stoke wheel's path
#   scripts/python-package.sh --release --no-install --wheel   # build only
#   ... --client-wheel                            # print the stoke-client wheel's path
#
# Two distributions, one `stoke` package folder, no file in common:
#
# - stoke-client (python/client): stoke/__init__.py, stoke.Client (the
#   compiled stoke._native_client, the limited API: one cp311-abi3 wheel for
#   CPython 3.11 and later), and the `stoke` and `stoke-coordinator`
#   commands; no torch.
# - stoke (python/): depends on stoke-client and torch==2.11.0; the
#   processor API, torch_batch_process and the worker (stoke._native, which
#   links libtorch, on the limited API too: one cp311-abi3 wheel). The
#   `stoke-worker` command runs the worker in the installing Python
#   (stoke/_worker.py), and stoke/bin/ holds the stoke-worker and
#   stoke-embedded scripts that `stoke run` finds beside `stoke`; nothing
#   links libpython (ADR 022).
#
# The release build bundles stoke-client's binaries (`cargo build --release`
# of stoke-cli and stoke-coordinator, stripped) in its stoke/bin/; those
# commands are launchers (stoke/_launch.py) that exec them. The dev build
# bundles none (the tests use the cargo-built ones on PATH).
#
# Both wheels are tagged manylinux_2_34 (maturin's --compatibility): the
# extensions and the binaries need glibc 2.34 and libstdc++'s GLIBCXX_3.4.29
# at most, which is checked here after each build; the stoke wheel declares
# torch==2.11.0, whose libtorch it loads from torch/lib beside it (never a
# bundled copy).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

profile=dev
install=1
print_wheel=0
print_client_wheel=0
for arg in "$@"; do
  case "$arg" in
    --release) profile=release ;;
    --wheel) print_wheel=1 ;;
    --client-wheel) print_client_wheel=1 ;;
    --no-install) install=0 ;;
    *) echo "python-package.sh: unknown argument $arg (--release, --wheel, --client-wheel, --no-install)" >&2; exit 2 ;;
  esac
done
# The platform tag, and the newest glibc / libstdc++ symbol versions it allows.
compat=manylinux_2_34
max_glibc=2.34
max_glibcxx=3.4.29

tools="maturin==1.16.0 pytest"
tools_marker="$STOKE_VENV/.stoke-python-tools"
if [ ! -f "$tools_marker" ] || [ "$(cat "$tools_marker")" != "$tools" ]; then
  # shellcheck disable=SC2086
  "$STOKE_VENV/bin/pip" install --disable-pip-version-check -q $tools
  echo "$tools" >"$tools_marker"
fi

# The stoke distribution pins stoke-client to its own version: Cargo's.
version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)"
if ! grep -q "\"stoke-client==$version\"" python/pyproject.toml; then
  echo "python-package.sh: python/pyproject.toml must depend on stoke-client==$version (the workspace's version)" >&2
  exit 1
fi

# Everything the wheels are made from.
key="$(
  { git ls-files -z -- python worker data core store client coordinator proto sdk cli build-helper Cargo.toml Cargo.lock \
      | sort -z | xargs -0 sha256sum; echo "$profile $compat"; } | sha256sum | cut -c1-16
)-$profile"
wheels="$STOKE_CACHE/wheels"
installed_marker="$STOKE_VENV/.stoke-python-package"

# The release binaries, into stoke-client's stoke/bin/ (emptied first, so a
# dev build after a release one bundles nothing stale). The stoke
# distribution's stoke/bin/ holds two scripts, in git.
stage_binaries() {
  rm -rf python/client/stoke/bin
  [ "$profile" = release ] || return 0
  echo "stoke: building the release binaries (cargo build --release)" >&2
  cargo build --release --locked -p stoke-cli -p stoke-coordinator --bins >&2
  mkdir -p python/client/stoke/bin
  local out="$CARGO_TARGET_DIR/release" name
  for name in stoke stoke-coordinator; do
    strip -o "python/client/stoke/bin/$name" "$out/$name"
  done
  chmod 755 python/client/stoke/bin/*
}

# Newest glibc / libstdc++ symbol versions of every ELF file in a wheel.
check_symbols() {
  "$STOKE_VENV/bin/python" - "$1" "$max_glibc" "$max_glibcxx" <<'PY'
import re, subprocess, sys, tempfile, zipfile
wheel, limits = sys.argv[1], {"GLIBC": sys.argv[2], "GLIBCXX": sys.argv[3]}
key = lambda v: tuple(int(x) for x in v.split("."))
with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        with z.open(name) as f:
            if f.read(4) != b"\x7fELF":
                continue
        symbols = subprocess.run(["objdump", "-T", z.extract(name, tmp)], capture_output=True, text=True, check=True).stdout
        for lib, limit in limits.items():
            newest = max((m for m in re.findall(rf"\b{lib}_([0-9.]+)\b", symbols)), key=key, default="0")
            if key(newest) > key(limit):
                sys.exit(f"{name} needs {lib}_{newest}, newer than its tag allows ({lib}_{limit})")
PY
}

wheel="$(ls "$wheels/$key"/stoke-[0-9]*.whl 2>/dev/null | head -n1 || true)"
client_wheel="$(ls "$wheels/$key"/stoke_client-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ] || [ -z "$client_wheel" ]; then
  stage_binaries
  echo "stoke: building the stoke and stoke-client Python distributions (maturin, $profile)" >&2
  rm -rf "$wheels/$key.tmp"
  mkdir -p "$wheels/$key.tmp"
  # In the shared target folder: it reuses the workspace's compiled
  # dependencies. --auditwheel skip: libtorch is torch's (the wheel depends
  # on torch==2.11.0 and finds torch/lib through its rpath), never a copy
  # bundled into this wheel; the tag's symbol limits are checked below.
  # The release extensions are stripped, as the binaries are (a third of
  # their size is symbols).
  strip=()
  [ "$profile" = dev ] || strip=(--strip)
  for manifest in python/client/Cargo.toml python/Cargo.toml; do
    "$STOKE_VENV/bin/maturin" build --quiet --profile "$profile" --manifest-path "$manifest" \
        --interpreter "$STOKE_VENV/bin/python" --compatibility "$compat" --auditwheel skip \
        "${strip[@]}" --out "$wheels/$key.tmp" >&2
  done
  rm -rf python/client/stoke/bin
  for built in "$wheels/$key.tmp"/*.whl; do
    check_symbols "$built"
  done
  rm -rf "${wheels:?}/$key"
  mv "$wheels/$key.tmp" "$wheels/$key"
  wheel="$(ls "$wheels/$key"/stoke-[0-9]*.whl | head -n1)"
  client_wheel="$(ls "$wheels/$key"/stoke_client-*.whl | head -n1)"
fi
if [ "$install" = 1 ] && { [ ! -f "$installed_marker" ] || [ "$(cat "$installed_marker")" != "$key" ]; }; then
  # Both out first: the two distributions share the stoke/ folder, and a
  # venv may hold the single `stoke` of before the split, whose record
  # lists stoke/__init__.py (now stoke-client's). Reinstalled in one pip
  # command, removing the old `stoke` after stoke-client was written would
  # delete that file, and `import stoke` would find an empty namespace.
  "$STOKE_VENV/bin/pip" uninstall --disable-pip-version-check -q -y stoke stoke-client >/dev/null 2>&1 || true
  "$STOKE_VENV/bin/pip" install --disable-pip-version-check -q --no-deps "$client_wheel" "$wheel"
  if ! "$STOKE_VENV/bin/python" -c "import stoke, sys; stoke.TorchBatchProcessor; stoke.Client" 2>/dev/null; then
    echo "python-package.sh: the installed stoke package does not import (stoke.TorchBatchProcessor, stoke.Client)" >&2
    exit 1
  fi
  echo "$key" >"$installed_marker"
fi
if [ "$print_wheel" = 1 ]; then
  echo "$wheel"
fi
if [ "$print_client_wheel" = 1 ]; then
  echo "$client_wheel"
fi
