#!/usr/bin/env bash
# Measures what failures cost (kill -9 of a worker, SIGTERM, kill -9 of the
# coordinator) with real processes, and runs the full chaos schedule. The
# figures go to RELIABILITY.md by hand, with the machine they came from.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"
cargo build -q --workspace --bins
echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB"
# Each run's whole output is kept; a failed run fails the script (its
# output's tail says why), it is never filtered away.
log="$STOKE_CACHE/last-reliability.log"
if ! cargo test -q -p stoke-tests --test measure -- --ignored --nocapture >"$log" 2>&1; then
  tail -40 "$log" >&2
  echo "reliability: the measurements failed (whole output: $log)" >&2
  exit 1
fi
grep '^RELIABILITY' "$log"
if ! cargo test -q -p stoke-tests --test chaos -- --ignored --nocapture >"$log.chaos" 2>&1; then
  tail -60 "$log.chaos" >&2
  echo "reliability: the full chaos run failed (whole output: $log.chaos)" >&2
  exit 1
fi
grep -iE 'chaos|seed|records|missing|duplicated|events' "$log.chaos"
