#!/usr/bin/env bash
# Builds the `stoke` Python package (python/: maturin, PyO3) and installs it
# into the stoke venv; idempotent and cached: a wheel is built only when the
# sources it is made from change (keyed on their hash and the profile), and
# kept in ~/.cache/stoke/wheels. Also installs the build and test tools it
# needs (maturin, pytest) into the venv, once.
#
#   scripts/python-package.sh                     # dev build (the tests'), install
#   scripts/python-package.sh --release           # the release build, what users install
#   scripts/python-package.sh --release --wheel   # ... and print the wheel's path
#   scripts/python-package.sh --release --no-install --wheel   # build only
#
# Both wheels are tagged manylinux_2_34 (maturin's --compatibility): the
# extension needs glibc 2.34 and libstdc++'s GLIBCXX_3.4.29 at most, which
# is checked here after each build; they declare torch==2.11.0, whose
# libtorch they load from torch/lib beside them (never a bundled copy).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

profile=dev
install=1
print_wheel=0
for arg in "$@"; do
  case "$arg" in
    --release) profile=release ;;
    --wheel) print_wheel=1 ;;
    --no-install) install=0 ;;
    *) echo "python-package.sh: unknown argument $arg (--release, --wheel, --no-install)" >&2; exit 2 ;;
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

# Everything the extension module is compiled from.
key="$(
  { git ls-files -z -- python worker data core store client coordinator proto sdk build-helper Cargo.toml Cargo.lock \
      | sort -z | xargs -0 sha256sum; echo "$profile $compat"; } | sha256sum | cut -c1-16
)-$profile"
wheels="$STOKE_CACHE/wheels"
installed_marker="$STOKE_VENV/.stoke-python-package"
wheel="$(ls "$wheels/$key"/stoke-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
  echo "stoke: building the stoke Python package (maturin)" >&2
  rm -rf "$wheels/$key.tmp"
  mkdir -p "$wheels/$key.tmp"
  # In the shared target folder: it reuses the workspace's compiled
  # dependencies. --auditwheel skip: libtorch is torch's (the wheel depends
  # on torch==2.11.0 and finds torch/lib through its rpath), never a copy
  # bundled into this wheel; the tag's symbol limits are checked below.
  "$STOKE_VENV/bin/maturin" build --quiet --profile "$profile" --manifest-path python/Cargo.toml \
      --interpreter "$STOKE_VENV/bin/python" --compatibility "$compat" --auditwheel skip \
      --out "$wheels/$key.tmp" >&2
  wheel="$(ls "$wheels/$key.tmp"/stoke-*.whl | head -n1)"
  "$STOKE_VENV/bin/python" - "$wheel" "$max_glibc" "$max_glibcxx" <<'PY'
import re, subprocess, sys, tempfile, zipfile
wheel, limits = sys.argv[1], {"GLIBC": sys.argv[2], "GLIBCXX": sys.argv[3]}
key = lambda v: tuple(int(x) for x in v.split("."))
with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
    for name in (n for n in z.namelist() if n.endswith(".so")):
        symbols = subprocess.run(["objdump", "-T", z.extract(name, tmp)], capture_output=True, text=True, check=True).stdout
        for lib, limit in limits.items():
            newest = max((m for m in re.findall(rf"\b{lib}_([0-9.]+)\b", symbols)), key=key, default="0")
            if key(newest) > key(limit):
                sys.exit(f"{name} needs {lib}_{newest}, newer than its tag allows ({lib}_{limit})")
PY
  rm -rf "$wheels/$key"
  mv "$wheels/$key.tmp" "$wheels/$key"
  wheel="$(ls "$wheels/$key"/stoke-*.whl | head -n1)"
fi
if [ "$install" = 1 ] && { [ ! -f "$installed_marker" ] || [ "$(cat "$installed_marker")" != "$key" ]; }; then
  "$STOKE_VENV/bin/pip" install --disable-pip-version-check -q --no-deps --force-reinstall "$wheel"
  echo "$key" >"$installed_marker"
fi
if [ "$print_wheel" = 1 ]; then
  echo "$wheel"
fi
