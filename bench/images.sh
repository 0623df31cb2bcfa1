#!/usr/bin/env bash
# Issue 32's image benchmark: 20,000 PNG images (96x96), decoded and
# transformed per record, then a small CNN, by four contenders side by
# side in one run (see bench/images.py):
#   (a) loop            DataLoader(batch_size=64, num_workers=2) -> model -> torch.save
#   (b) stoke-dataset   torch_batch_process(..., dataset, dataloader_kwargs={"num_workers": 2}), in process,
#                       on the release wheel; stoke-dataset-dev the same on the dev wheel
#   (c) stoke-load-fn-2 stoke over the PNG files, load_fn on 2 load processes, `run --local 1`,
#                       the model on batch.collated (the load process's batch, no copy)
#       stoke-load-fn-2-stack  the same with Graphbook's step as written: torch.stack(batch.samples)
#       stoke-load-fn-1 (c) with 1 load process (load_fn's records/s, 1 against 2)
#   (d) ray             Ray Data read_images + map_batches
#
#   bench/images.sh [COUNT] [ROUNDS]     # defaults: 20000 images, 1 round
#
# Issue 48's loading-bound case, Graphbook's load_fn with 12 Gaussian
# blurs and a resize per image, a small CNN, shards of 500 records, `run
# --local 1`: `[loading] workers = 1` against `workers = 2`, at batch
# sizes 8 and 64, the two interleaved in each round (their order swapped
# every round), the load average noted before each run:
#
#   bench/images.sh load-bound [COUNT] [ROUNDS]   # defaults: 2000 images, 5 rounds
#
# BENCH_CONTENDERS (space-separated names, default all of them) picks which
# run; the loop always runs, first in each round, as every ratio's base.
# BENCH_RAY=0 skips Ray (and its venv).
#
# Ray Data goes in its own venv (~/.cache/stoke/bench-ray-venv), which
# sees the stoke venv's torch, torchvision and pillow through a .pth file
# instead of installing torch again; the stoke venv stays free of Ray.
# Prints one line per run and two tables of records/s and ratios (the
# whole command, and the steady state; see bench/images.py); nothing
# asserts a wall-clock limit. STOKE_BENCH_DEVICE=cuda:0 puts the model of
# (a)-(c) on a GPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$STOKE_REPO"

DIR="$STOKE_CACHE/bench/images"
RESULTS="$DIR/results-$(date +%Y%m%d-%H%M%S).txt"
RAY_VENV="$STOKE_CACHE/bench-ray-venv"
RAY_REQS="ray[data]==2.60.0"
mkdir -p "$DIR"

# The PNG files (96x96, the same on every run).
images() {
  if [ ! -f "$1/.done" ]; then
    rm -rf "$1"
    python bench/images.py data "$1" "$2"
    touch "$1/.done"
  fi
}

if [ "${1:-}" = load-bound ]; then
  COUNT="${2:-2000}"
  ROUNDS="${3:-5}"
  DATA="$DIR/data-$COUNT"
  echo "building stoke (release)" >&2
  cargo build --release -q -p stoke-cli -p stoke-worker
  export PATH="$CARGO_TARGET_DIR/release:$PATH"
  echo "builds: release stoke; the stoke package $(basename "$(scripts/python-package.sh --release --wheel)") (release) in the venv, which the worker imports" | tee -a "$RESULTS"
  images "$DATA" "$COUNT"
  for round in $(seq 1 "$ROUNDS"); do
    echo "round $round of $ROUNDS" >&2
    order="1 2"
    if [ $((round % 2)) = 0 ]; then order="2 1"; fi
    for batch in 8 64; do
      for workers in $order; do
        name="load-bound-b$batch-w$workers"
        work="$DIR/work/$name"
        rm -rf "$work"
        load="$(cut -d' ' -f1 /proc/loadavg)"
        started=$(date +%s.%N)
        if python bench/images.py load-bound "$DATA" "$work" "$workers" "$batch" >"$work.log" 2>&1; then
          ended=$(date +%s.%N)
          echo "$(grep '^result ' "$work.log" | tail -1) wall=$(echo "$ended - $started" | bc) load=$load round=$round" | tee -a "$RESULTS"
        else
          echo "result contender=$name failed (see $work.log)" | tee -a "$RESULTS"
        fi
      done
    done
  done
  python - "$RESULTS" <<'PY'
import re, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    m = re.match(r"result contender=load-bound-b(\d+)-w(\d+) records=(\d+) seconds=[\d.]+ steady=([\d.]+) wall=([\d.]+) load=([\d.]+) round=(\d+)", line)
    if m:
        runs[(int(m[1]), int(m[2]), int(m[7]))] = (int(m[3]) / float(m[5]), float(m[4]), float(m[6]))
print("\n2 load processes against 1, per round (records/s ratio; load average before the two runs)")
print(f"{'batch':>5}  {'whole command':<40}{'median':>7}{'min':>6}  {'steady state':<40}{'median':>7}{'min':>6}")
for batch in sorted({b for b, _, _ in runs}):
    rounds = sorted(r for b, w, r in runs if b == batch and w == 1 and (batch, 2, r) in runs)
    whole = [runs[(batch, 2, r)][0] / runs[(batch, 1, r)][0] for r in rounds]
    steady = [runs[(batch, 2, r)][1] / runs[(batch, 1, r)][1] for r in rounds if runs[(batch, 1, r)][1] > 0]
    loads = [f"{runs[(batch, 1, r)][2]:.1f}/{runs[(batch, 2, r)][2]:.1f}" for r in rounds]
    if not whole:
        continue
    cell = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
    print(f"{batch:>5}  {cell(whole):<40}{statistics.median(whole):>7.2f}{min(whole):>6.2f}  "
          f"{cell(steady):<40}{statistics.median(steady) if steady else float('nan'):>7.2f}{min(steady, default=float('nan')):>6.2f}")
    print(f"{'':>5}  load averages (1 / 2 processes): {', '.join(loads)}")
print(f"\nresults: {sys.argv[1]}")
PY
  exit 0
fi

COUNT="${1:-20000}"
ROUNDS="${2:-1}"
DATA="$DIR/data-$COUNT"

# (c) runs the `stoke` command: the release build, as users run it (the
# other benchmarks in bench/run.sh use release builds too). (b) runs
# through the stoke Python package: the release wheel, installed in the
# venv as the docs tell users to (scripts/python-package.sh --release), and
# beside it, as stoke-dataset-dev, the dev wheel the tests use, unpacked
# into a folder of its own that goes first on PYTHONPATH for its runs.
CONTENDERS="${BENCH_CONTENDERS:-stoke-dataset stoke-dataset-dev stoke-load-fn-2 stoke-load-fn-2-stack stoke-load-fn-1 ray}"
wanted() { [[ " $CONTENDERS " == *" $1 "* ]]; }

if [[ " $CONTENDERS " == *" stoke-load-fn"* ]]; then
  echo "building stoke (release)" >&2
  cargo build --release -q -p stoke-cli -p stoke-worker
  export PATH="$CARGO_TARGET_DIR/release:$PATH"
fi
release_wheel="$(scripts/python-package.sh --release --wheel)"
dev_wheel="$(scripts/python-package.sh --no-install --wheel)"
DEV_PKG="$DIR/pkg-dev"
rm -rf "$DEV_PKG"
pip install --disable-pip-version-check -q --no-deps --target "$DEV_PKG" "$dev_wheel"
echo "builds: stoke-dataset on $(basename "$release_wheel") (release); stoke-dataset-dev on the dev profile's $(basename "$dev_wheel")" | tee -a "$RESULTS"

images "$DATA" "$COUNT"

ray_python=""
if [ "${BENCH_RAY:-1}" != 0 ] && wanted ray; then
  if [ ! -f "$RAY_VENV/.installed" ] || [ "$(cat "$RAY_VENV/.installed")" != "$RAY_REQS" ]; then
    [ -x "$RAY_VENV/bin/pip" ] || python3 -m venv "$RAY_VENV"
    "$RAY_VENV/bin/pip" install --disable-pip-version-check -q "$RAY_REQS" && echo "$RAY_REQS" >"$RAY_VENV/.installed"
  fi
  # Every run: the stoke venv may have moved (STOKE_VENV) since the Ray
  # venv was made, and a stale path hides torch from Ray's workers.
  site="$("$RAY_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/stoke-venv.pth"
  ray_python="$RAY_VENV/bin/python"
fi

run() {
  local name="$1"; shift
  local work="$DIR/work/$name"
  rm -rf "$work"; mkdir -p "$work"
  local started ended
  started=$(date +%s.%N)
  if "$@" >"$work.log" 2>&1; then
    ended=$(date +%s.%N)
    echo "$(grep '^result ' "$work.log" | tail -1) wall=$(echo "$ended - $started" | bc)" | tee -a "$RESULTS"
  else
    echo "result contender=$name failed (see $work.log)" | tee -a "$RESULTS"
  fi
}

# A contender BENCH_CONTENDERS names.
run_if() {
  if wanted "$1"; then run "$@"; fi
}

for round in $(seq 1 "$ROUNDS"); do
  echo "round $round of $ROUNDS" >&2
  run loop python bench/images.py loop "$DATA" "$DIR/work/loop/out"
  run_if stoke-dataset python bench/images.py stoke-dataset "$DATA" "$DIR/work/stoke-dataset/root"
  run_if stoke-dataset-dev env PYTHONPATH="$DEV_PKG" BENCH_NAME=stoke-dataset-dev \
    python bench/images.py stoke-dataset "$DATA" "$DIR/work/stoke-dataset-dev/root"
  run_if stoke-load-fn-2 python bench/images.py stoke-load-fn "$DATA" "$DIR/work/stoke-load-fn-2/root" 2
  run_if stoke-load-fn-2-stack python bench/images.py stoke-load-fn "$DATA" "$DIR/work/stoke-load-fn-2-stack/root" 2 stack
  run_if stoke-load-fn-1 python bench/images.py stoke-load-fn "$DATA" "$DIR/work/stoke-load-fn-1/root" 1
  if [ -n "$ray_python" ]; then
    run ray "$ray_python" bench/images.py ray "$DATA" "$DIR/work/ray/out"
  fi
done

python - "$RESULTS" <<'PY'
import re, statistics, sys
wall, steady = {}, {}
for line in open(sys.argv[1]):
    m = re.match(r"result contender=(\S+) records=(\d+) seconds=[\d.]+ steady=([\d.]+) wall=([\d.]+)", line)
    if m:
        wall.setdefault(m[1], []).append(int(m[2]) / float(m[4]))
        if float(m[3]) > 0:
            steady.setdefault(m[1], []).append(float(m[3]))
names = ["loop", "stoke-dataset", "stoke-dataset-dev", "stoke-load-fn-2", "stoke-load-fn-2-stack", "stoke-load-fn-1", "ray"]
for title, runs in (("whole command (records / wall time, start-up included)", wall),
                    ("steady state (records/s from the first output part to the last)", steady)):
    rate = {k: statistics.median(v) for k, v in runs.items()}
    a, d = rate.get("loop"), rate.get("ray")
    # Each round runs every contender once, the loop first: a contender
    # against the loop of its own round cancels the machine's drift
    # between rounds, which the medians of records/s do not.
    loops = runs.get("loop", [])
    print(f"\n{title}\n{'contender':<18}{'records/s':>12}{'vs (a)':>9}{'vs (d)':>9}{'runs':>6}"
          f"  vs (a) per round (median)")
    for name in names:
        if name in rate:
            r = rate[name]
            rounds = [x / l for x, l in zip(runs[name], loops)] if len(runs[name]) == len(loops) else []
            per_round = (", ".join(f"{x:.2f}" for x in rounds) + f" ({statistics.median(rounds):.2f})") if rounds else "-"
            print(f"{name:<18}{r:>12.0f}{(r / a if a else float('nan')):>9.2f}{(r / d if d else float('nan')):>9.2f}"
                  f"{len(runs[name]):>6}  {per_round}")
print(f"\nresults: {sys.argv[1]}")
PY
