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
#   wheel     `pip install stoke` as a user meets it: the release wheels in
#             fresh venvs with no Rust toolchain, the book's first job, a
#             coordinator and 2 workers from the venv's bin, a Python
#             processor, torch_batch_process, the client-only install
#             (scripts/wheel-test.sh); about 2.5 minutes with the release
#             wheels built (torch's 2.7 GiB downloaded each run: pip caches
#             nothing from this registry), about 25 more on a fresh 2-core
#             machine for the release build (binaries 18, wheels 4)
#   image     the container images built from the wheels with buildah and a
#             job run through 2 workers from the worker image
#             (scripts/image.sh; root); about 3 minutes with the wheels,
#             the debootstrap base and the wheelhouse cached, 2 more for the
#             base and 1 for the wheelhouse the first time
#
# Usage: scripts/long.sh [suite...]   (all five by default)
# Each suite's whole output goes to ~/.cache/stoke/long/<suite>.log. Ends
# with one summary line, `long suites: chaos ok (412 s), ...`; exits 1 if
# any suite failed. Takes about 15 minutes on 2 cores for the first three,
# plus the wheel and image suites' times above (about 6 minutes once the
# release build is cached; its first build, shared by both, about 25).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

SUITES=(chaos measure bench_s3 wheel image)
# Suites that are scripts, not cargo tests.
declare -A SCRIPT_SUITES=([wheel]=scripts/wheel-test.sh [image]=scripts/image.sh)
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
CARGO_SUITES=()
for suite in "${SUITES[@]}"; do
  [ -n "${SCRIPT_SUITES[$suite]:-}" ] || CARGO_SUITES+=("$suite")
done
if [ "${#CARGO_SUITES[@]}" -gt 0 ]; then
  "$STOKE_REPO/scripts/s3-server.sh" >/dev/null
  cargo build -q --workspace --bins
  cargo test -q -p stoke-tests "${CARGO_SUITES[@]/#/--test=}" --no-run 2>&1 | tail -5 >&2
fi

results=()
failed=0
for suite in "${SUITES[@]}"; do
  echo "== $suite (log: $LOGS/$suite.log)" >&2
  started=$SECONDS
  if [ -n "${SCRIPT_SUITES[$suite]:-}" ]; then
    run=("$STOKE_REPO/${SCRIPT_SUITES[$suite]}")
  else
    run=(cargo test -q -p stoke-tests --test "$suite" -- --ignored --nocapture)
  fi
  if "${run[@]}" >"$LOGS/$suite.log" 2>&1; then
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
