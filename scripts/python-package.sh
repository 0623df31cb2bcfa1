#!/usr/bin/env bash
# Builds the `stoke` Python package (python/: maturin, PyO3) and installs it
# into the stoke venv; idempotent and cached: a wheel is built only when the
# sources it is made from change (keyed on their hash), and kept in
# ~/.cache/stoke/wheels. Also installs the build and test tools it needs
# (maturin, pytest) into the venv, once.
#
#   scripts/python-package.sh            # build if needed, install
#   scripts/python-package.sh --wheel    # print the wheel's path too
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

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
      | sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-16
)"
wheels="$STOKE_CACHE/wheels"
installed_marker="$STOKE_VENV/.stoke-python-package"
wheel="$(ls "$wheels/$key"/stoke-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
  echo "stoke: building the stoke Python package (maturin)" >&2
  rm -rf "$wheels/$key.tmp"
  mkdir -p "$wheels/$key.tmp"
  # Debug profile in the shared target folder: it reuses the workspace's
  # compiled dependencies. --auditwheel skip: libtorch is torch's (the
  # wheel depends on torch==2.11.0 and finds torch/lib through its rpath),
  # never a copy bundled into this wheel.
  "$STOKE_VENV/bin/maturin" build --quiet --profile dev --manifest-path python/Cargo.toml \
      --interpreter "$STOKE_VENV/bin/python" --auditwheel skip --out "$wheels/$key.tmp" >&2
  rm -rf "$wheels/$key"
  mv "$wheels/$key.tmp" "$wheels/$key"
  wheel="$(ls "$wheels/$key"/stoke-*.whl | head -n1)"
fi
if [ ! -f "$installed_marker" ] || [ "$(cat "$installed_marker")" != "$key" ]; then
  "$STOKE_VENV/bin/pip" install --disable-pip-version-check -q --no-deps --force-reinstall "$wheel"
  echo "$key" >"$installed_marker"
fi
if [ "${1:-}" = "--wheel" ]; then
  echo "$wheel"
fi
