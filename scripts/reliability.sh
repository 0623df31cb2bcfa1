#!/usr/bin/env bash
# Measures what failures cost (kill -9 of a worker, SIGTERM, kill -9 of the
# coordinator) with real processes, and runs the full chaos schedule. The
# figures go to RELIABILITY.md by hand, with the machine they came from.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"
cargo build -q --workspace --bins
echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB"
cargo test -q -p stoke-tests --test measure -- --ignored --nocapture 2>&1 | grep '^RELIABILITY'
if [ -f tests/tests/chaos.rs ]; then
  cargo test -q -p stoke-tests --test chaos -- --ignored --nocapture 2>&1 | grep -iE 'chaos|seed|records|missing|duplicated|events' || true
fi
