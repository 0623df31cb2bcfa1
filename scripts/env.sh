# shellcheck shell=bash
# Sourced by every stoke script: one place that sets up the toolchain.
#
# - a Python venv with torch==2.11.0 (libtorch for tch 0.24), numpy, pyarrow,
#   torchvision (its release for torch 2.11.0), pillow, cloudpickle,
#   scikit-learn, and the readers tests check tables with (deltalake,
#   pyiceberg with adlfs for abfss:// tables, DuckDB 1.5.5 with its iceberg extension from PyPI: no
#   extension downloads at run time), kept in ~/.cache/stoke/venv so every
#   clone reuses it;
# - a shared cargo target folder in ~/.cache/stoke/target;
# - LIBTORCH_USE_PYTORCH=1 with the venv's python first on PATH, as tch's
#   build expects. The binaries carry an rpath to torch/lib (see the crates'
#   build.rs), so they run without LD_LIBRARY_PATH.
#
# Idempotent: a marker file records what was installed.

STOKE_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STOKE_CACHE="${STOKE_CACHE:-$HOME/.cache/stoke}"
STOKE_VENV="${STOKE_VENV:-$STOKE_CACHE/venv}"
STOKE_PY_REQS="torch==2.11.0 numpy pyarrow scikit-learn duckdb==1.5.5 duckdb-extension-iceberg==1.5.5 duckdb-extension-avro==1.5.5 torchvision==0.26.0 pillow==13.0.0 cloudpickle==3.1.3 deltalake==1.6.6 pyiceberg[sql-sqlite]==0.12.0 adlfs==2026.8.0"
export STOKE_REPO STOKE_CACHE STOKE_VENV

stoke_venv() {
  local marker="$STOKE_VENV/.stoke-installed"
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$STOKE_PY_REQS" ]; then
    return 0
  fi
  echo "stoke: setting up the Python venv with torch in $STOKE_VENV (first time: a few minutes)" >&2
  mkdir -p "$STOKE_CACHE"
  [ -x "$STOKE_VENV/bin/python" ] || python3 -m venv "$STOKE_VENV"
  # shellcheck disable=SC2086
  "$STOKE_VENV/bin/pip" install --disable-pip-version-check -q $STOKE_PY_REQS
  echo "$STOKE_PY_REQS" >"$marker"
}

stoke_venv
export PATH="$STOKE_VENV/bin:$PATH"
# The repository's commit-msg hook (.githooks): subject of at most 72
# characters, a blank line, a body.
if [ -d "$STOKE_REPO/.git" ] || [ -f "$STOKE_REPO/.git" ]; then
  if [ "$(git -C "$STOKE_REPO" config --get core.hooksPath || true)" != ".githooks" ]; then
    git -C "$STOKE_REPO" config core.hooksPath .githooks || true
  fi
fi
export LIBTORCH_USE_PYTORCH=1
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$STOKE_CACHE/target}"
export STOKE_BIN_DIR="$CARGO_TARGET_DIR/debug"
# `stoke`, `stoke-coordinator` and `stoke-worker` as built here, on PATH
# (`cargo build` puts them there; `cargo install --path cli` and friends
# install them for use outside the repository).
case ":$PATH:" in
  *":$STOKE_BIN_DIR:"*) ;;
  *) export PATH="$STOKE_BIN_DIR:$PATH" ;;
esac
