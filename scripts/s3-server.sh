#!/usr/bin/env bash
# Installs the S3-protocol server the tests run on loopback (s3s-fs from
# crates.io, a real S3 server over a local folder) into ~/.cache/stoke/tools
# and prints its path. Idempotent: a second run only prints the path.
#
# s3s-fs 0.14.1 is the newest release that builds with this machine's rustc;
# it honours If-None-Match: * and If-Match on PUT, which stoke's durable
# state relies on (tests/tests/s3.rs checks that it still does).
set -euo pipefail
STOKE_CACHE="${STOKE_CACHE:-$HOME/.cache/stoke}"
TOOLS="$STOKE_CACHE/tools"
VERSION="0.14.1"
BIN="$TOOLS/bin/s3s-fs"
MARKER="$TOOLS/.s3s-fs-$VERSION"
if [ ! -x "$BIN" ] || [ ! -f "$MARKER" ]; then
  echo "stoke: installing s3s-fs $VERSION into $TOOLS (first time: about 2 minutes)" >&2
  mkdir -p "$TOOLS"
  # Its own target folder, so it neither shares nor invalidates stoke's.
  CARGO_TARGET_DIR="$STOKE_CACHE/tools-target" \
    cargo install -q --locked "s3s-fs@$VERSION" --features binary --root "$TOOLS" >&2
  touch "$MARKER"
fi
echo "$BIN"
