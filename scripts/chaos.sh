#!/usr/bin/env bash
# The full chaos test: a 30,000-record job with a coordinator and 3 workers
# while a seeded schedule injects 20 worker kill -9, 5 worker SIGTERMs, 3
# coordinator kill -9 + restarts on the same port and root, and a worker
# SIGSTOP held past the lease timeout; then every record is checked against
# torch's own outputs, computed in Python when the fixture is built
# (scripts/chaos_fixture.py; tests/tests/chaos.rs, tests/src/chaos.rs).
#
# Usage: scripts/chaos.sh [SEED]
#   SEED (or STOKE_CHAOS_SEED) replays a schedule; without one a seed is
#   drawn and printed first ("chaos seed: N").
#   STOKE_CHAOS_KEEP=1 keeps the run's folder (logs, root) even on success.
#
# Prints the run's report; exits non-zero if the test failed. The whole
# output is also in $STOKE_CACHE/last-chaos.log.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

if [ $# -gt 1 ]; then
  echo "usage: $0 [SEED]" >&2
  exit 2
fi
if [ $# -eq 1 ]; then
  export STOKE_CHAOS_SEED="$1"
fi

echo "== building" >&2
cargo build -q -p stoke-coordinator -p stoke-worker -p stoke-cli -p stoke --bins
cargo test -q -p stoke-tests --test chaos --no-run

log="$STOKE_CACHE/last-chaos.log"
echo "== chaos (full schedule; a few minutes)" >&2
status=0
cargo test -p stoke-tests --test chaos -- --ignored --nocapture 2>&1 | tee "$log" || status=$?

echo
echo "== report"
# The report block the driver prints, and the seed to replay it.
sed -n '/^chaos seed: /p; /^chaos report$/,/^  logs: /p' "$log"
if [ "$status" -ne 0 ]; then
  seed=$(sed -n 's/^chaos seed: //p' "$log" | head -1)
  echo "chaos FAILED (seed ${seed:-unknown}; replay: scripts/chaos.sh ${seed:-SEED}); full output: $log" >&2
fi
exit "$status"
