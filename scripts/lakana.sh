#!/usr/bin/env bash
# Installs lakana-server, an Iceberg REST catalog server from PyPI (Python,
# on pyiceberg and FastAPI, SQLite-backed), into its own venv in
# ~/.cache/stoke/tools/lakana and prints that venv's folder. Idempotent: a
# second run only prints it.
#
# The tests run stoke's `catalog = { type = "rest", ... }` against it
# (tests/src/iceberg.rs), as they run `s3://` against s3s-fs.
set -euo pipefail
STOKE_CACHE="${STOKE_CACHE:-$HOME/.cache/stoke}"
DIR="$STOKE_CACHE/tools/lakana"
PACKAGES="lakana-server==0.20.0"
MARKER="$DIR/.installed"
if [ ! -x "$DIR/bin/lakana-server" ] || [ ! -f "$MARKER" ] || [ "$(cat "$MARKER")" != "$PACKAGES" ]; then
  echo "stoke: installing $PACKAGES into $DIR (first time: under a minute)" >&2
  mkdir -p "$STOKE_CACHE/tools"
  python3 -m venv "$DIR"
  # shellcheck disable=SC2086
  "$DIR/bin/pip" install --disable-pip-version-check -q $PACKAGES >&2
  echo "$PACKAGES" >"$MARKER"
fi
echo "$DIR"
