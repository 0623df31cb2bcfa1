#!/usr/bin/env bash
# Installs Azurite, Microsoft's Azure Storage emulator (npm), and the Azure
# Blob SDK the tests create containers with, into ~/.cache/stoke/tools and
# prints the folder they are in. Idempotent: a second run only prints it.
#
# The tests run stoke's `az://` stores against it (tests/src/azurite.rs),
# as they run `s3://` against s3s-fs (scripts/s3-server.sh).
set -euo pipefail
STOKE_CACHE="${STOKE_CACHE:-$HOME/.cache/stoke}"
DIR="$STOKE_CACHE/tools/azurite"
PACKAGES="azurite@3.35.0 @azure/storage-blob@12.29.1"
MARKER="$DIR/.installed"
if [ ! -x "$DIR/node_modules/.bin/azurite-blob" ] || [ ! -f "$MARKER" ] || [ "$(cat "$MARKER")" != "$PACKAGES" ]; then
  if ! command -v npm >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "stoke: installing npm (Debian) for the Azure emulator" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >&2 || true
  fi
  command -v npm >/dev/null || { echo "stoke: npm (Node.js) is needed for the Azure emulator, Azurite" >&2; exit 1; }
  echo "stoke: installing $PACKAGES into $DIR (first time: under a minute)" >&2
  mkdir -p "$DIR"
  # shellcheck disable=SC2086
  (cd "$DIR" && npm install --no-audit --no-fund --silent --no-save $PACKAGES >&2)
  echo "$PACKAGES" >"$MARKER"
fi
echo "$DIR"
