#!/usr/bin/env bash
# Issue 60's benchmark rows: the pip-installed wheel against cargo's binaries.
#
#   bench/wheel.sh          # W1 `stoke run --local 2`: the wheel's `stoke` (launcher,
#                           #   bundled binary, workers run in the venv's Python: ADR 022)
#                           #   against cargo's target/release/stoke (cargo's stoke-worker
#                           #   binary), paired, BENCH_RUNS pairs (default 9); then the
#                           #   bundled `stoke` run directly against cargo's; then a
#                           #   command's start through the launcher (`stoke --version`)
#   bench/wheel.sh cold     # cold installs (pip's cache off, the registry's download
#                           #   included) of the stoke wheel and of stoke-client alone,
#                           #   each into a fresh venv: time, download and installed size
#
# Times with farm-bench (the machines' whole-process timer: medians of
# paired runs, A/B per pair). Builds the release wheels and binaries
# (scripts/python-package.sh --release; cached) and W1's data
# (bench/w1_data.py) first; the wheel's venv is ~/.cache/stoke/bench/wheel-venv.
set -euo pipefail
BENCH_SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../scripts/env.sh
source "$BENCH_SRC/../scripts/env.sh"
cd "$STOKE_REPO"

what="${1:-w1}"
case "$what" in
  w1 | cold) ;;
  *) echo "usage: bench/wheel.sh [w1|cold]" >&2; exit 2 ;;
esac
command -v farm-bench >/dev/null || { echo "bench/wheel.sh: farm-bench is not on PATH" >&2; exit 1; }
log() { echo "bench: $*" >&2; }

wheel="$(scripts/python-package.sh --release --no-install --wheel)"
client_wheel="$(scripts/python-package.sh --release --no-install --client-wheel)"
# cargo's side: stoke and the stoke-worker binary beside it.
cargo build --release --locked -q -p stoke-cli -p stoke-worker --bins >&2
base_python="$(python -c 'import os, sys; print(os.path.realpath(sys._base_executable))')"
mib() { awk -v b="$1" 'BEGIN { printf "%.0f MiB", b / 1048576 }'; }

if [ "$what" = cold ]; then
  for target in "$wheel" "$client_wheel"; do
    venv="$(mktemp -d)/venv"
    "$base_python" -m venv "$venv"
    bare=$(du -sb "$venv" | cut -f1)
    t0=$(date +%s.%N)
    PIP_NO_CACHE_DIR=1 "$venv/bin/pip" install -q --find-links "$(dirname "$wheel")" "$target" >&2
    t1=$(date +%s.%N)
    log "$(basename "$target"): cold install $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') s, installed $(mib $(($(du -sb "$venv" | cut -f1) - bare))), load $(cut -d' ' -f1-3 /proc/loadavg)"
    rm -rf "$(dirname "$venv")"
  done
  exit 0
fi

venv="$STOKE_CACHE/bench/wheel-venv"
key="$(sha256sum "$wheel" "$client_wheel" | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.stoke-wheels" 2>/dev/null)" != "$key" ]; then
  log "installing the release wheels into $venv"
  rm -rf "$venv"
  "$base_python" -m venv "$venv"
  PIP_CACHE_DIR="$STOKE_CACHE/pip" "$venv/bin/pip" install -q --find-links "$(dirname "$wheel")" "$wheel" >&2
  echo "$key" >"$venv/.stoke-wheels"
fi
w1="$STOKE_CACHE/bench/w1"
python "$BENCH_SRC/w1_data.py" "$w1" >&2
sed "s|@W1_DIR@|$w1|g" "$BENCH_SRC/w1.toml" >"$w1/job.toml"
runs="${BENCH_RUNS:-9}"
cargo_stoke="$CARGO_TARGET_DIR/release/stoke"
bundled="$("$venv/bin/python" -c 'import stoke._launch as l; print(l.binary("stoke"))')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
run() { echo "sh -c 'rm -rf $work/$1 && exec $2 run $w1/job.toml --local 2 --device cpu --threads 1 --root $work/$1'"; }

log "W1 --local 2: A = the wheel's stoke (launcher), B = cargo's target/release/stoke"
eval "farm-bench -n $runs --warmup 1 --timeout 900 --vs \"$(run b "$cargo_stoke")\" -- $(run a "$venv/bin/stoke")"
log "W1 --local 2: A = the wheel's bundled stoke run directly (its workers in the venv's Python), B = cargo's"
eval "farm-bench -n $runs --warmup 1 --timeout 900 --vs \"$(run b "$cargo_stoke")\" -- $(run a "$bundled")"
log "a command's start: A = stoke --version through the launcher, B = the bundled binary"
farm-bench -n 20 --warmup 2 --vs "$bundled --version" -- "$venv/bin/stoke" --version
