#!/usr/bin/env bash
# Issue 32's image workload with the model on a GPU (the device tool):
# (a) the DataLoader loop, (b) torch_batch_process with the Dataset in
# process, (c) load_fn on 2 load processes through `stoke run --local 1`,
# each with pin_memory=True and STOKE_BENCH_DEVICE=cuda:0, the same
# settings as on dev-2 (2 loader processes, 1 intra-op thread, batches
# of 64). GPU utilisation is sampled by nvidia-smi every 100 ms during
# each run; the report gives records/s, the mean utilisation and the
# share of samples with the GPU busy at all.
# Carries the release wheels (no cargo there) in .gpu/ (excluded from git):
#   cp ~/.cache/stoke/wheels/<key>-release/*.whl .gpu/
#   then on the device: REPO=$PWD bash bench/gpu/images.sh [COUNT] [ROUNDS] [LOADERS...]
# LOADERS: the loader processes of each set of runs (default 2, as on dev-2).
set -u
COUNT="${1:-20000}"
ROUNDS="${2:-2}"
LOADERS="${*:3}"; LOADERS="${LOADERS:-2}"
W=/tmp/gpuimages; rm -rf $W; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $W/site "$REPO"/.gpu/*.whl || exit 1
export PYTHONPATH=$W/site PATH=$W/site/bin:$PATH STOKE_DEFAULT_PYTHON=python3
export STOKE_BENCH_DEVICE=${STOKE_BENCH_DEVICE:-cuda:0}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nproc
python3 -c "import torch, stoke; print('torch', torch.__version__, torch.cuda.is_available(), 'stoke', stoke.__file__)"
# Seconds from $1 to $2 (or now); the machine has no bc.
elapsed() { python3 -c "import sys,time; print(f'{float(sys.argv[2] if len(sys.argv) > 2 else time.time()) - float(sys.argv[1]):.2f}')" "$@"; }
started=$(date +%s.%N)
python3 "$REPO/bench/images.py" data $W/data "$COUNT" || exit 1
echo "data: $COUNT PNGs in $(elapsed $started) s"
run() { # NAME ARGS...
  name=$1; shift
  smi=""; : >$W/util-$name.txt
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 >$W/util-$name.txt 2>/dev/null &
    smi=$!
  fi
  s=$(date +%s.%N)
  python3 "$REPO/bench/images.py" "$@" > $W/$name.log 2>&1
  rc=$?
  e=$(date +%s.%N)
  [ -n "$smi" ] && { kill $smi; wait $smi 2>/dev/null; }
  util=$(python3 -c "
import sys
xs=[float(l) for l in open('$W/util-$name.txt') if l.strip().replace('.','',1).isdigit()]
print(f'util_mean={sum(xs)/max(len(xs),1):.1f} util_busy={sum(x>0 for x in xs)/max(len(xs),1):.2f} samples={len(xs)}')")
  if [ $rc = 0 ]; then
    echo "$(grep '^result ' $W/$name.log | tail -1) wall=$(elapsed $s $e) $util round=$round"
  else
    echo "result contender=$name failed rc=$rc"; tail -20 $W/$name.log
  fi
}
for round in $(seq 1 "$ROUNDS"); do
  for loaders in $LOADERS; do
    export STOKE_BENCH_LOADERS=$loaders
    echo "round $round: $loaders loader processes"
    rm -rf $W/out-*
    run loop loop $W/data $W/out-loop
    run stoke-dataset stoke-dataset $W/data $W/out-dataset
    run stoke-load-fn-$loaders stoke-load-fn $W/data $W/out-loadfn $loaders
  done
done
