#!/usr/bin/env bash
# The suites too long for scripts/test.sh, each `#[ignore]`d there so the
# CI run stays well under its limit, run here one after another:
#
#   chaos     the full chaos schedule: a 30,000-record job under 20 worker
#             kill -9, 5 SIGTERMs, 3 coordinator restarts and a freeze past
#             the lease timeout, checked against torch's own outputs
#             (tests/tests/chaos.rs; scripts/chaos.sh runs it alone, with a
#             seed)
#   measure   what failures cost, for RELIABILITY.md (tests/tests/measure.rs)
#   bench_s3  W1 on the local S3 server against file:// (tests/tests/bench_s3.rs)
#
# Usage: scripts/long.sh [suite...]   (all three by default)
# Each suite's whole output goes to ~/.cache/stoke/long/<suite>.log. Ends
# with one summary line, `long suites: chaos ok (412 s), ...`; exits 1 if
# any suite failed. Takes about 15 minutes on 2 cores.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

SUITES=(chaos measure bench_s3)
if [ $# -gt 0 ]; then
  for s in "$@"; do
    [[ " ${SUITES[*]} " == *" $s "* ]] || {
      echo "unknown suite $s (known: ${SUITES[*]})" >&2
      exit 2
    }
  done
  SUITES=("$@")
fi
LOGS="$STOKE_CACHE/long"
mkdir -p "$LOGS"
"$STOKE_REPO/scripts/s3-server.sh" >/dev/null
cargo build -q --workspace --bins
cargo test -q -p stoke-tests "${SUITES[@]/#/--test=}" --no-run 2>&1 | tail -5 >&2

results=()
failed=0
for suite in "${SUITES[@]}"; do
  echo "== $suite (log: $LOGS/$suite.log)" >&2
  started=$SECONDS
  if cargo test -q -p stoke-tests --test "$suite" -- --ignored --nocapture >"$LOGS/$suite.log" 2>&1; then
    results+=("$suite ok ($((SECONDS - started)) s)")
  else
    tail -30 "$LOGS/$suite.log" >&2
    results+=("$suite FAILED ($((SECONDS - started)) s, $LOGS/$suite.log)")
    failed=1
  fi
done
summary="$(printf '%s, ' "${results[@]}")"
echo "long suites: ${summary%, }"
exit "$failed"
