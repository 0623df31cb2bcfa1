#!/usr/bin/env bash
# Issue 49: a CPU pool feeding a GPU pool (a pipeline of two stages, each
# on its own pool) against one pool of workers that each decode for
# themselves, at the same total CPU (2 cores: a cgroup quota per worker),
# on an image workload where preprocessing dominates. See bench/pipeline.py.
#
#   bench/pipeline.sh [COUNT] [ROUNDS]     # defaults: 2000 images, 3 rounds
#
# BENCH_DECODE_SHARE (default 1.75): the decode worker's cores in the
# two-pool set-up; the classify worker gets the rest of 2 (Ray Data the
# same split). BENCH_RAY=0 skips Ray Data, which runs from its own venv
# (~/.cache/stoke/bench-ray-venv, ray[data] 2.60.0, seeing the stoke
# venv's torch, torchvision and Pillow through a .pth file).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$STOKE_REPO"

COUNT="${1:-2000}"
ROUNDS="${2:-3}"
SHARE="${BENCH_DECODE_SHARE:-1.75}"
DIR="$STOKE_CACHE/bench/pipeline"
DATA="$DIR/data-$COUNT"
RESULTS="$DIR/results-$(date +%Y%m%d-%H%M%S).jsonl"
RAY_VENV="$STOKE_CACHE/bench-ray-venv"
RAY_REQS="ray[data]==2.60.0"
mkdir -p "$DIR"
ray_python=""
if [ "${BENCH_RAY:-1}" != 0 ]; then
  if [ ! -f "$RAY_VENV/.installed" ] || [ "$(cat "$RAY_VENV/.installed")" != "$RAY_REQS" ]; then
    [ -x "$RAY_VENV/bin/pip" ] || python3 -m venv "$RAY_VENV"
    "$RAY_VENV/bin/pip" install --disable-pip-version-check -q "$RAY_REQS" && echo "$RAY_REQS" >"$RAY_VENV/.installed"
  fi
  site="$("$RAY_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$site/stoke-venv.pth"
  ray_python="$RAY_VENV/bin/python"
fi

echo "building stoke (release)" >&2
cargo build --release -q -p stoke-cli -p stoke-worker -p stoke-coordinator
scripts/python-package.sh --release >/dev/null
if [ ! -f "$DATA/.done" ]; then
  rm -rf "$DATA"
  python bench/pipeline.py data "$DATA" "$COUNT"
  touch "$DATA/.done"
fi
for round in $(seq 1 "$ROUNDS"); do
  order="one-pool two-pools ray"
  if [ $((round % 2)) = 0 ]; then order="ray two-pools one-pool"; fi
  for setup in $order; do
    echo "round $round of $ROUNDS: $setup (load $(cut -d' ' -f1 /proc/loadavg))" >&2
    if [ "$setup" = ray ]; then
      [ -n "$ray_python" ] || continue
      "$ray_python" bench/pipeline.py ray "$DATA" "$DIR/work" --decode-share "$SHARE" | tee -a "$RESULTS"
    else
      python bench/pipeline.py run "$CARGO_TARGET_DIR/release" "$DATA" "$DIR/work" "$setup" \
        --decode-share "$SHARE" | tee -a "$RESULTS"
    fi
    rm -rf "$DIR/work"
  done
done
python bench/pipeline.py table "$RESULTS"
echo "results: $RESULTS"
