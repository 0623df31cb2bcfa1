#!/usr/bin/env bash
# Installs the headless browser the status-page test renders the page in
# (Debian's `chromium` package) and prints its path. Idempotent: when
# chromium is already on PATH it only prints the path. Runs unattended (CI
# starts from a fresh machine): as root directly, otherwise through sudo.
set -euo pipefail
if path="$(command -v chromium)"; then
  echo "$path"
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null; then
  as_root=(sudo -n)
else
  echo "stoke: chromium is missing and this user is not root (and has no sudo); install the chromium package" >&2
  exit 1
fi
echo "stoke: installing chromium for the status-page test (first time: a minute or two)" >&2
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -q >&2
"${as_root[@]}" apt-get install -y -q --no-install-recommends chromium >&2
command -v chromium
