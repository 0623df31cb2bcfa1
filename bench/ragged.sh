#!/usr/bin/env bash
# The ragged workload: variable-length sequences padded per batch, a fixed
# batch size against an element budget (adaptive batching). Reports
# records/s (stoke embedded, 2 threads, median of BENCH_RUNS runs) and the
# padding waste of each rule. Part of bench/run.sh; runs alone as
# `bench/ragged.sh`.
set -euo pipefail
BENCH_SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../scripts/env.sh
source "$BENCH_SRC/../scripts/env.sh"
RUNS="${BENCH_RUNS:-3}"
DIR="$STOKE_CACHE/bench/ragged"
mkdir -p "$DIR"
cargo build -q --release -p stoke-cli -p stoke -p stoke-worker
STOKE_BIN="$CARGO_TARGET_DIR/release/stoke"
python "$BENCH_SRC/ragged_data.py" "$DIR"

FIXED=$'[batching]\nbatch_size = 64'
BUDGET=$'[batching]\nbatch_size = 256\nmax_elements = 4096\nlength_column = "tokens"'

spec() { # name batching
  local out="$DIR/$1.toml"
  python - "$BENCH_SRC/ragged.toml" "$DIR" "$2" "$out" <<'PY'
import sys
src, d, batching, out = sys.argv[1:]
open(out, "w").write(open(src).read().replace("@DIR@", d).replace("@BATCHING@", batching))
PY
  echo "$out"
}

run_one() { # spec -> seconds
  local root="$DIR/root-$$"
  rm -rf "$root"
  local t0 t1
  t0=$(date +%s.%N)
  "$STOKE_BIN" run "$1" --embedded --device cpu --threads 2 --root "$root" >"$DIR/last.out" 2>"$DIR/last.err"
  t1=$(date +%s.%N)
  grep -q '^records: 60000/60000' "$DIR/last.out" || { cat "$DIR/last.out" "$DIR/last.err" >&2; exit 1; }
  rm -rf "$root"
  python -c "print($t1 - $t0)"
}

median() { python -c "import statistics,sys; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }

fixed_spec=$(spec fixed "$FIXED")
budget_spec=$(spec budget "$BUDGET")
fixed_times=()
budget_times=()
for _ in $(seq "$RUNS"); do
  fixed_times+=("$(run_one "$fixed_spec")")
  budget_times+=("$(run_one "$budget_spec")")
done
fixed_s=$(median "${fixed_times[@]}")
budget_s=$(median "${budget_times[@]}")
fixed_waste=$(python "$BENCH_SRC/ragged_waste.py" "$DIR/lengths.npy" 4 64)
budget_waste=$(python "$BENCH_SRC/ragged_waste.py" "$DIR/lengths.npy" 4 256 4096)
echo
echo "### Ragged workload (60,000 sequences, lengths 4-512, log-normal; stoke embedded, 2 threads, median of $RUNS)"
echo
echo "| batching | records/s | padding | batches |"
echo "|---|---|---|---|"
python - "$fixed_s" "$budget_s" "$fixed_waste" "$budget_waste" <<'PY'
import sys
fs, bs, fw, bw = sys.argv[1:]
def parse(w):
    return dict(kv.split("=") for kv in w.split())
for name, s, w in [("fixed: batch_size = 64", float(fs), parse(fw)),
                   ("budget: max_elements = 4096 (batch_size <= 256)", float(bs), parse(bw))]:
    print(f"| {name} | {60000 / s:,.0f} | {float(w['waste']):.0%} of padded elements | {w['batches']} |")
print()
print(f"budget / fixed records/s: {float(fs) / float(bs):.2f}x")
PY
