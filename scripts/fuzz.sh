#!/usr/bin/env bash
# Fuzzes what stoke reads from outside, each target for a bounded time:
#   spec_toml, spec_json   job specs as submitted (parse, validate, plan a
#                          range job, round trip through spec.json)
#   progress_record        the coordinator's stored records (progress
#                          records and logs,
#                          status, manifest, epoch, lock)
#   plan                   a stored plan.json
#   float_list             Parquet files through the worker's fast path for
#                          fixed-size float lists (stoke_data::float_list),
#                          checked against Arrow's reader
# The checks live in fuzz/src/lib.rs; data/tests/fuzz_regressions.rs replays
# the inputs kept in data/tests/fuzz-regressions/<target>/ in every test run.
# Not part of scripts/test.sh: it takes minutes.
#
# Usage: scripts/fuzz.sh [target...]        (all five by default)
#   FUZZ_SECONDS    seconds per target (default 60)
#   FUZZ_SANITIZER  address (default) or none
#
# Works on the stable toolchain: cargo-fuzz passes nightly-only flags
# (-Zsanitizer=address, -Cpasses=sancov-module), which RUSTC_BOOTSTRAP=1
# lets stable rustc take. cargo-fuzz is installed once into
# ~/.cache/stoke/tools; the first build takes about 15 minutes on 2 cores
# (every dependency built with ASan into ~/.cache/stoke/fuzz-target), later
# ones under a minute. Corpora persist in ~/.cache/stoke/fuzz-corpus/<target>,
# seeded from the kept inputs and the repo's example specs.
#
# Exits 1 if a target crashed (a panic, an abort, a hang past 10 s, more
# than 2 GiB), printing the input's path. Then: minimise it
#   RUSTC_BOOTSTRAP=1 cargo fuzz tmin --target-dir ~/.cache/stoke/fuzz-target <target> <path>
# fix the bug, and keep the minimised input in
# data/tests/fuzz-regressions/<target>/crash-<what>.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

TARGETS=(spec_toml spec_json progress_record plan float_list)
FUZZ_SECONDS="${FUZZ_SECONDS:-60}"
FUZZ_SANITIZER="${FUZZ_SANITIZER:-address}"
TOOLS="$STOKE_CACHE/tools"
CARGO_FUZZ_VERSION="0.13.2"
FUZZ_TARGET_DIR="$STOKE_CACHE/fuzz-target"
CORPORA="$STOKE_CACHE/fuzz-corpus"
ARTIFACTS="$STOKE_CACHE/fuzz-artifacts"
LOGS="$STOKE_CACHE/fuzz-logs"
export RUSTC_BOOTSTRAP=1
export PATH="$TOOLS/bin:$PATH"

install_cargo_fuzz() {
  local marker="$TOOLS/.cargo-fuzz-$CARGO_FUZZ_VERSION"
  if [ -x "$TOOLS/bin/cargo-fuzz" ] && [ -f "$marker" ]; then
    return 0
  fi
  echo "stoke: installing cargo-fuzz $CARGO_FUZZ_VERSION into $TOOLS (first time: about a minute)" >&2
  mkdir -p "$TOOLS"
  # Its own target folder, so it neither shares nor invalidates stoke's.
  CARGO_TARGET_DIR="$STOKE_CACHE/tools-target" \
    cargo install -q --locked "cargo-fuzz@$CARGO_FUZZ_VERSION" --root "$TOOLS" >&2
  touch "$marker"
}

fuzz_build() {
  cargo fuzz build --sanitizer "$1" --target-dir "$FUZZ_TARGET_DIR" "${@:2}"
}

# The repo's example specs, placeholders filled in, as TOML and JSON.
seed_examples() {
  local toml_dir="$CORPORA/spec_toml" json_dir="$CORPORA/spec_json"
  sed 's|@W1_DIR@|/data/w1|g' bench/w1.toml >"$toml_dir/example-w1.toml"
  sed -e 's|@DIR@|/data/ragged|g' \
    -e 's|@BATCHING@|[batching]\nbatch_size = 4096\nmax_elements = 65536\nlength_column = "tokens"|' \
    bench/ragged.toml >"$toml_dir/example-ragged.toml"
  cp deploy/k8s/submit/digits.toml "$toml_dir/example-digits.toml"
  python3 - "$toml_dir" "$json_dir" <<'EOF'
import json, pathlib, sys, tomllib
toml_dir, json_dir = map(pathlib.Path, sys.argv[1:])
for path in toml_dir.glob("example-*.toml"):
    spec = tomllib.loads(path.read_text())
    (json_dir / f"{path.stem}.json").write_text(json.dumps(spec, default=str))
EOF
}

seed_corpora() {
  local target
  for target in "${TARGETS[@]}"; do
    mkdir -p "$CORPORA/$target"
    cp data/tests/fuzz-regressions/"$target"/* "$CORPORA/$target/"
  done
  seed_examples
}

dict_for() {
  case "$1" in
    spec_*) echo "$STOKE_REPO/fuzz/dicts/spec.dict" ;;
    float_list) echo "$STOKE_REPO/fuzz/dicts/parquet.dict" ;;
    *) echo "$STOKE_REPO/fuzz/dicts/records.dict" ;;
  esac
}

# Runs one target; prints a summary, or the crashing input and returns 1.
run_target() {
  local target="$1" log="$LOGS/$1.log"
  mkdir -p "$ARTIFACTS/$target"
  echo "== fuzz $target (${FUZZ_SECONDS}s, log $log)"
  # -timeout: one input running 10 s is a hang; -rss_limit_mb bounds
  # memory (and each allocation); -use_value_profile lets comparisons with
  # limits guide the search towards them.
  if cargo fuzz run --sanitizer "$FUZZ_SANITIZER" --target-dir "$FUZZ_TARGET_DIR" \
    "$target" "$CORPORA/$target" -- \
    -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 \
    -use_value_profile=1 -dict="$(dict_for "$target")" \
    -artifact_prefix="$ARTIFACTS/$target/" -print_final_stats=1 >"$log" 2>&1; then
    grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true
    return 0
  fi
  grep -E 'panicked at|^SUMMARY|^==[0-9]+==ERROR' "$log" | head -5 >&2 || true
  local crash
  crash="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | grep -v '/slow-unit-' | tail -1)"
  echo "fuzz $target: CRASH, input ${crash:-not written (see $log)}" >&2
  return 1
}

main() {
  local targets=("$@") target failed=()
  [ ${#targets[@]} -gt 0 ] || targets=("${TARGETS[@]}")
  for target in "${targets[@]}"; do
    [[ " ${TARGETS[*]} " == *" $target "* ]] || {
      echo "unknown fuzz target $target (known: ${TARGETS[*]})" >&2
      exit 2
    }
  done
  install_cargo_fuzz
  mkdir -p "$LOGS"
  echo "== cargo fuzz build (sanitizer $FUZZ_SANITIZER)"
  if ! fuzz_build "$FUZZ_SANITIZER" >"$LOGS/build.log" 2>&1; then
    if [ "$FUZZ_SANITIZER" = none ]; then
      tail -20 "$LOGS/build.log" >&2
      exit 1
    fi
    tail -20 "$LOGS/build.log" >&2
    echo "fuzz: the $FUZZ_SANITIZER sanitizer build failed (see $LOGS/build.log); FUZZ_SANITIZER=none fuzzes without one, knowingly" >&2
    exit 1
  fi
  seed_corpora
  for target in "${targets[@]}"; do
    run_target "$target" || failed+=("$target")
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzzing found crashes in: ${failed[*]}" >&2
    exit 1
  fi
  echo "fuzzing: no crashes (${#targets[@]} targets, ${FUZZ_SECONDS}s each, sanitizer $FUZZ_SANITIZER)"
}

main "$@"
