#!/usr/bin/env bash
# Runs stoke's benchmarks in one go and prints a markdown report.
#
#   bench/run.sh           # everything: W1 end to end, coordinator scale, ragged
#   bench/run.sh w1        # only W1: (a) model floor, (b) plain Python,
#                          #   (c) Ray Data, (d) stoke embedded, (e) stoke --local 1/2
#   bench/run.sh scale     # only the coordinator scale benchmark (deadline
#                          #   simulation included)
#   bench/run.sh scale-deadline # only the deadline simulation: a job with a
#                          #   deadline and a budget on the state machine, an
#                          #   autoscaler following stoke_workers_wanted, 20 seeds;
#                          #   fails (non-zero) when a target is missed
#   bench/run.sh ragged    # only the ragged workload (fixed batches vs a budget)
#   bench/run.sh pt2       # W1 with --local 2, the model as TorchScript vs as a
#                          #   .pt2 package (AOTInductor), interleaved
#   bench/run.sh python    # W1 with --local 2 through a Python processor
#                          #   (bench/w1_python_processor.py) vs the built-in
#                          #   runner vs plain Python, interleaved; and both
#                          #   submitted to a fleet that is already up
#   bench/run.sh straggler # W1's data, a heavier model, 3 workers, one duty-cycled
#                          #   to a quarter speed: splitting off vs on vs Ray Data,
#                          #   against the ideal (bench/straggler.py)
#   bench/run.sh straggler-late # 36,000 records as JSON Lines, workers started
#                          #   after the submit: 2 fast alone vs 2 fast + 1 slowed
#                          #   from its start (SIGSTOP duty cycle; a CPU quota),
#                          #   interleaved, wall(2 + slow) / wall(2), and a control
#                          #   (the slow process never given work); in two set-ups
#                          #   (BENCH_LATE_SETUPS, default "budget shared"): a CPU
#                          #   budget per worker, and fast workers filling the cores
#   bench/run.sh split     # W1 with shard splitting on and off (--local 1 and 2),
#                          #   against the floor
#   bench/run.sh iceberg   # W1 with --local 2 writing Parquet objects vs an Iceberg
#                          # table (SQLite catalog), an append at the end and per group
#   bench/run.sh delta     # W1 with --local 2 writing Parquet objects vs a Delta
#                          #   table (commit = "end", and "checkpoint"), interleaved
#   BENCH_BASE_BIN=DIR bench/run.sh compare
#                          # W1 with --local 2, this build vs another's binaries in
#                          #   DIR (an older commit's target/release), and the floor
#   bench/run.sh link      # W1's data on one worker whose link to the coordinator
#                          #   holds every chunk 0, 50 and 200 ms each way (a
#                          #   proxy): a slower model at checkpoint intervals 100
#                          #   (the default) and 5, W1's model at 100, interleaved
#                          #   (bench/link.py); ratios to 0 ms
#   bench/run.sh s3        # W1 with --local 2 on file:// vs the local S3 server,
#                          #   and store requests per checkpoint (a counting proxy)
#
# Environment: BENCH_RUNS (runs per W1 contender, default 3), BENCH_SCALE_SECONDS
# (seconds per worker count, default 10), BENCH_SCALE_WORKERS (default
# 10,100,1000), BENCH_PLAN_SHARDS (default 1000000), BENCH_RAY=0 to skip Ray,
# BENCH_SCALE_COORDINATOR_CPUS (CPUs for the coordinator in `scale`'s pinned
# runs, default 0-1 on a machine with 4 or more; `none` skips those runs).
#
# Idempotent; caches in ~/.cache/stoke/bench/ (workload, logs, results) and a
# separate venv ~/.cache/stoke/bench-venv with torch, pyarrow, numpy and
# ray[data] (the stoke venv stays free of Ray). Builds with --release. The
# report also lands in ~/.cache/stoke/bench/report.md. Nothing asserts a
# wall-clock limit: the report compares ratios with the targets and says
# met or missed.
set -euo pipefail

what="${1:-all}"
case "$what" in
  all | w1 | scale | scale-deadline | ragged | s3 | pt2 | python | split | delta | iceberg | compare | straggler | straggler-late | incremental | link) ;;
  *)
    echo "usage: bench/run.sh [all|w1|scale|scale-deadline|ragged|s3|pt2|python|split|delta|iceberg|compare|straggler|straggler-late|incremental|link]" >&2
    exit 2
    ;;
esac

BENCH_SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The interpreter the bench venv is made from, before env.sh puts the stoke
# venv first on PATH.
SYSTEM_PYTHON="$(command -v python3)"
# shellcheck source=../scripts/env.sh
source "$BENCH_SRC/../scripts/env.sh"

BENCH_DIR="$STOKE_CACHE/bench"
BENCH_VENV="$STOKE_CACHE/bench-venv"
BENCH_PY_REQS='torch==2.11.0 pyarrow numpy ray[data]'
RUNS="${BENCH_RUNS:-3}"
W1_RECORDS=200000
mkdir -p "$BENCH_DIR"

log() { echo "bench: $*" >&2; }

bench_venv() {
  local marker="$BENCH_VENV/.bench-installed"
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$BENCH_PY_REQS" ]; then
    return 0
  fi
  log "setting up $BENCH_VENV ($BENCH_PY_REQS; pip reuses its cache)"
  [ -x "$BENCH_VENV/bin/python" ] || "$SYSTEM_PYTHON" -m venv "$BENCH_VENV"
  # shellcheck disable=SC2086
  if "$BENCH_VENV/bin/pip" install --disable-pip-version-check -q $BENCH_PY_REQS; then
    echo "$BENCH_PY_REQS" >"$marker"
    return 0
  fi
  # Without Ray the other contenders still run; the report says so.
  log "installing ray[data] failed; trying without it"
  "$BENCH_VENV/bin/pip" install --disable-pip-version-check -q torch==2.11.0 pyarrow numpy
}

machine_info() {
  local cpu mem_kib
  cpu="$(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  mem_kib="$(grep -m1 '^MemTotal' /proc/meminfo | awk '{print $2}')"
  "$BENCH_VENV/bin/python" - "$BENCH_DIR/machine.json" "$cpu" "$mem_kib" <<'EOF'
import json, os, platform, subprocess, sys, datetime
out, cpu, mem_kib = sys.argv[1], sys.argv[2], int(sys.argv[3])
def version(mod):
    try:
        return __import__(mod).__version__
    except Exception as e:
        return f"not available ({type(e).__name__})"
rev = subprocess.run(["git", "-C", os.environ["STOKE_REPO"], "rev-parse", "--short", "HEAD"],
                     capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "-C", os.environ["STOKE_REPO"], "status", "--porcelain"],
                       capture_output=True, text=True).stdout.strip()
info = {
    "date (UTC)": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    "cores (nproc)": os.cpu_count(),
    "memory": f"{mem_kib / 2**20:.1f} GiB",
    "CPU": cpu,
    "kernel": platform.release(),
    "stoke commit": rev + (" (working tree has uncommitted changes)" if dirty else ""),
    "Python": platform.python_version(),
    "torch / pyarrow / ray": f"{version('torch')} / {version('pyarrow')} / {version('ray')}",
    # Anything else running skews every figure; this says whether the box was quiet.
    "load average at start (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
}
with open(out, "w") as f:
    json.dump(info, f, indent=1)
EOF
}

build() {
  log "building stoke (release)"
  case "$what" in
    # Only the three binaries the straggler runs start (a release build of
    # everything takes long on 2 cores).
    straggler | straggler-late | link)
      (cd "$STOKE_REPO" && cargo build --release -q -p stoke-cli -p stoke-worker -p stoke-coordinator)
      ;;
    *)
      (cd "$STOKE_REPO" && cargo build --release -q -p stoke-cli -p stoke -p stoke-worker -p stoke-coordinator -p stoke-bench-scale)
      ;;
  esac
}

# One measured run of one contender: run_one NAME KIND ROUND [OUT_DIR] -- CMD...
run_one() {
  local name="$1" kind="$2" round="$3" out_dir="$4"
  shift 5
  local logs="$BENCH_DIR/logs/$name-r$round"
  rm -rf "$logs"
  mkdir -p "$logs"
  # Every run starts with the inputs and the shared libraries (libtorch and
  # everything it links, for the Python contenders and for stoke alike) in
  # the page cache: this VM gives back cache memory quickly, and a cold
  # read would land on whichever contender comes first in a round.
  cat "$W1"/data/*.parquet "$W1"/model.pt* "${WARM_LIBS[@]}" >/dev/null
  "$BPY" "$BENCH_SRC/measure.py" --json "$logs/measure.json" \
    --stdout "$logs/stdout.log" --stderr "$logs/stderr.log" -- "$@" || true
  local record=("$BPY" "$BENCH_SRC/record.py" --results "$RESULTS" --contender "$name"
    --kind "$kind" --round "$round" --measure "$logs/measure.json"
    --stdout "$logs/stdout.log" --stderr "$logs/stderr.log" --expect "$W1_RECORDS")
  if [ -n "$out_dir" ]; then
    record+=(--out-dir "$out_dir")
  fi
  if [ "$kind" = ray ]; then
    # Ray failing here is reported, not fatal: the others still run.
    if ! "${record[@]}"; then
      echo "run $name round $round failed; see $logs" >>"$BENCH_DIR/ray-status.txt"
    fi
  else
    "${record[@]}"
  fi
}

contender() {
  local name="$1" round="$2"
  local work="$BENCH_DIR/runs/$name"
  rm -rf "$work"
  mkdir -p "$work"
  # RUST_LOG: the workers' per-stage times (one line per shard) go to the logs.
  local stoke_log="warn,stoke_worker=info"
  case "$name" in
    floor)
      run_one "$name" floor "$round" "" -- "$BPY" "$BENCH_SRC/floor.py" "$W1" --threads 2
      ;;
    python)
      run_one "$name" python "$round" "$work/out" -- \
        "$BPY" "$BENCH_SRC/python_baseline.py" "$W1/data" "$W1/model.pt" "$work/out" --threads 2
      ;;
    ray-c1 | ray-c2)
      run_one "$name" ray "$round" "$work/out" -- \
        "$BPY" "$BENCH_SRC/ray_baseline.py" "$W1/data" "$W1/model.pt" "$work/out" \
        --concurrency "${name#ray-c}"
      ;;
    stoke-embedded)
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$SPEC" --embedded --device cpu --threads 2 --root "$work/root"
      ;;
    stoke-local-1)
      # One worker process, two processors (one per core, 1 thread each).
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$SPEC" --local 1 --device cpu,cpu --threads 1 --root "$work/root"
      ;;
    stoke-local-1-t2)
      # One worker process, one processor with 2 libtorch threads.
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$SPEC" --local 1 --device cpu --threads 2 --root "$work/root"
      ;;
    stoke-local-2)
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$SPEC" --local 2 --device cpu --threads 1 --root "$work/root"
      ;;
    stoke-local-2-base)
      # As stoke-local-2, with another build's binaries (BENCH_BASE_BIN,
      # e.g. an older commit's target/release): a change's cost, side by
      # side in one run.
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BENCH_BASE_BIN/stoke" run "$SPEC" --local 2 --device cpu --threads 1 --root "$work/root"
      ;;
    stoke-local-1-nosplit | stoke-local-2-nosplit)
      # As without -nosplit, with shard splitting off ([sharding] split =
      # false): what splitting does to W1's tail.
      local n="${name#stoke-local-}"
      n="${n%-nosplit}"
      local devices=cpu
      [ "$n" = 1 ] && devices=cpu,cpu
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$SPEC_NOSPLIT" --local "$n" --device "$devices" --threads 1 --root "$work/root"
      ;;
    stoke-local-2-python)
      # The same job through a Python processor (bench/w1_python_processor.py).
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$SPEC_PY" --local 2 --device cpu --threads 1 --root "$work/root"
      ;;
    stoke-local-1-python)
      # One worker process, two Python processors (cpu,cpu) sharing its
      # GIL: against stoke-local-1, what the shared GIL costs.
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$SPEC_PY" --local 1 --device cpu,cpu --threads 1 --root "$work/root"
      ;;
    stoke-fleet-2 | stoke-fleet-2-python)
      # A job submitted to a fleet that is already up (fleet_start): what
      # a cluster's users see, with no process start-up in the job.
      # `submit --wait` polls every 200 ms, so its wall time is coarse;
      # the job's own time (submit to end, the coordinator's clock) comes
      # from `stoke report` (wall_s) and is the fleet rows' job phase.
      local spec="$SPEC"
      [ "$name" = stoke-fleet-2-python ] && spec="$SPEC_PY"
      run_one "$name" stoke "$round" "" -- sh -c \
        '"$0" --coordinator "$1" submit "$2" --job-id "$3" --wait && "$0" --coordinator "$1" report "$3" --json' \
        "$BIN/stoke" "$FLEET_ADDR" "$spec" "$name-r$round"
      ;;
    stoke-local-2-delta | stoke-local-2-delta-checkpoint)
      # The same job writing a Delta table (a fresh one each run, in the
      # run's folder): one Delta commit at the end, or one per group.
      local commit=end
      [ "$name" = stoke-local-2-delta-checkpoint ] && commit=checkpoint
      # W1's spec ends with its [output] section: replace it.
      sed '/^\[output\]$/,$d' "$SPEC" >"$work/job.toml"
      printf '[output]\nformat = "delta"\nuri = "file://%s/table"\ncommit = "%s"\n' "$work" "$commit" >>"$work/job.toml"
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$work/job.toml" --local 2 --device cpu --threads 1 --root "$work/root"
      ;;
    stoke-local-2-iceberg | stoke-local-2-iceberg-checkpoint)
      # The same job appending to an Iceberg table through an SQLite
      # catalog (fresh ones each run, in the run's folder): one append at
      # the end, or one per group.
      local commit=end
      [ "$name" = stoke-local-2-iceberg-checkpoint ] && commit=checkpoint
      sed '/^\[output\]$/,$d' "$SPEC" >"$work/job.toml"
      printf '[output]\nformat = "iceberg"\ntable = "bench.w1"\ncatalog = { type = "sql", uri = "sqlite://%s/catalog.db", warehouse = "file://%s/warehouse" }\ncommit = "%s"\n' \
        "$work" "$work" "$commit" >>"$work/job.toml"
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$work/job.toml" --local 2 --device cpu --threads 1 --root "$work/root"
      ;;
    stoke-local-2-pt2)
      # The same job with W1's model exported as a .pt2 package.
      run_one "$name" stoke "$round" "" -- env RUST_LOG="$stoke_log" \
        "$BIN/stoke" run "$SPEC_PT2" --local 2 --device cpu --threads 1 --root "$work/root"
      ;;
  esac
  # Outputs are checked; only the logs are kept.
  rm -rf "$work"
}

# W1's data, its model both ways, and a spec for each.
prepare_w1() {
  W1="$BENCH_DIR/w1"
  SPEC="$W1/job.toml"
  SPEC_PT2="$W1/job-pt2.toml"
  RESULTS="$BENCH_DIR/w1-results.jsonl"
  log "generating W1 (if missing) in $W1"
  "$BPY" "$BENCH_SRC/w1_data.py" "$W1"
  "$BPY" "$BENCH_SRC/w1_pt2.py" "$W1"
  sed "s|@W1_DIR@|$W1|g" "$BENCH_SRC/w1.toml" >"$SPEC"
  sed -e 's|^name = "torchscript"|name = "pytorch"|' -e 's|/model.pt"|/model.pt2"|' "$SPEC" >"$SPEC_PT2"
  SPEC_NOSPLIT="$W1/job-nosplit.toml"
  sed 's|^records = 25000$|records = 25000\nsplit = false|' "$SPEC" >"$SPEC_NOSPLIT"
  grep -q '^split = false$' "$SPEC_NOSPLIT" || { log "could not turn splitting off in $SPEC_NOSPLIT"; exit 1; }
  SPEC_PY="$W1/job-python.toml"
  sed -e "s|^name = \"torchscript\"|python = \"w1_python_processor:W1Processor\"\npython_path = [\"$BENCH_SRC\"]|" \
    "$SPEC" >"$SPEC_PY"
}

# Runs contenders interleaved, rotating the order every round so drift
# (thermal, page cache) falls on every contender alike.
run_rounds() {
  local contenders=("$@")
  local n=${#contenders[@]}
  for round in $(seq 1 "$RUNS"); do
    log "W1 round $round of $RUNS"
    for i in $(seq 0 $((n - 1))); do
      contender "${contenders[$(((i + round - 1) % n))]}" "$round"
    done
  done
}

run_pt2() {
  prepare_w1
  rm -f "$RESULTS"
  echo "not run (bench/run.sh pt2)." >"$BENCH_DIR/ray-status.txt"
  run_rounds stoke-local-2 stoke-local-2-pt2
}

# A fleet that stays up between jobs, as a cluster's does: a coordinator
# and 2 workers (1 thread each, Python prewarmed), for stoke-fleet-2*.
fleet_start() {
  FLEET="$BENCH_DIR/fleet"
  fleet_stop
  rm -rf "$FLEET"
  mkdir -p "$FLEET"
  RUST_LOG=warn "$BIN/stoke-coordinator" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
    --root "$FLEET/root" --addr-file "$FLEET/addr" >"$FLEET/coordinator.log" 2>&1 &
  FLEET_PIDS=("$!")
  trap fleet_stop EXIT
  local waited=0
  until [ -s "$FLEET/addr" ]; do
    sleep 0.1
    waited=$((waited + 1))
    [ "$waited" -lt 300 ] || { log "the fleet's coordinator did not start: $FLEET/coordinator.log"; exit 1; }
  done
  FLEET_ADDR="http://$(cat "$FLEET/addr")"
  for i in 1 2; do
    RUST_LOG=warn,stoke_worker=info "$BIN/stoke-worker" --coordinator "$FLEET_ADDR" \
      --worker-id "fleet-$i" --device cpu --threads 1 --python-prewarm >"$FLEET/worker-$i.log" 2>&1 &
    FLEET_PIDS+=("$!")
  done
  waited=0
  until [ "$(cat "$FLEET"/worker-*.log | grep -c 'Python ready for processors')" -ge 2 ]; do
    sleep 0.1
    waited=$((waited + 1))
    [ "$waited" -lt 1200 ] || { log "the fleet's workers did not start Python: $FLEET/worker-*.log"; exit 1; }
  done
  log "fleet up at $FLEET_ADDR (2 workers, Python prewarmed)"
}

fleet_stop() {
  if [ "${#FLEET_PIDS[@]}" -gt 0 ]; then
    kill "${FLEET_PIDS[@]}" 2>/dev/null || true
    wait "${FLEET_PIDS[@]}" 2>/dev/null || true
  fi
  FLEET_PIDS=()
}
FLEET_PIDS=()

run_python() {
  prepare_w1
  rm -f "$RESULTS"
  echo "not run (bench/run.sh python)." >"$BENCH_DIR/ray-status.txt"
  "$STOKE_REPO/scripts/python-package.sh"
  fleet_start
  run_rounds python stoke-local-2 stoke-local-2-python stoke-local-1 stoke-local-1-python \
    stoke-fleet-2 stoke-fleet-2-python
  fleet_stop
  rm -rf "$FLEET"
}

run_w1() {
  prepare_w1
  rm -f "$RESULTS" "$BENCH_DIR/ray-status.txt"
  local contenders=(floor python)
  if [ "${BENCH_RAY:-1}" = 0 ]; then
    echo "not run (BENCH_RAY=0)." >"$BENCH_DIR/ray-status.txt"
  elif ! ray_error="$("$BPY" -c 'import ray, ray.data' 2>&1)"; then
    echo "not run: ray[data] could not be imported in $BENCH_VENV: $(echo "$ray_error" | tail -1)" \
      >"$BENCH_DIR/ray-status.txt"
    log "Ray Data is not available; (c) is left out (see the report)"
  else
    contenders+=(ray-c1 ray-c2)
  fi
  # The Python processor's worker imports the stoke package from the venv.
  "$STOKE_REPO/scripts/python-package.sh"
  contenders+=(stoke-embedded stoke-local-1 stoke-local-1-t2 stoke-local-2 stoke-local-2-pt2 stoke-local-2-python)
  run_rounds "${contenders[@]}"
}

# W1 with --local 2 against the same with another build (BENCH_BASE_BIN),
# and the floor.
run_compare() {
  [ -x "${BENCH_BASE_BIN:-}/stoke" ] || {
    log "bench/run.sh compare needs BENCH_BASE_BIN, a folder with another build's stoke, stoke-worker and stoke-coordinator"
    exit 2
  }
  prepare_w1
  rm -f "$RESULTS"
  echo "not run (bench/run.sh compare)." >"$BENCH_DIR/ray-status.txt"
  run_rounds floor stoke-local-2 stoke-local-2-base
}

# W1 writing Parquet objects against a Delta table (commit at the end, and
# per checkpoint group).
run_delta() {
  prepare_w1
  rm -f "$RESULTS"
  echo "not run (bench/run.sh delta)." >"$BENCH_DIR/ray-status.txt"
  run_rounds stoke-local-2 stoke-local-2-delta stoke-local-2-delta-checkpoint
}

# W1 writing Parquet objects against an Iceberg table (an append at the
# end, and one per checkpoint group), ADR 024.
run_iceberg() {
  prepare_w1
  rm -f "$RESULTS"
  echo "not run (bench/run.sh iceberg)." >"$BENCH_DIR/ray-status.txt"
  run_rounds stoke-local-2 stoke-local-2-iceberg stoke-local-2-iceberg-checkpoint
}

# W1 with shard splitting on (the default) and off, against the floor.
run_split() {
  prepare_w1
  rm -f "$RESULTS"
  echo "not run (bench/run.sh split)." >"$BENCH_DIR/ray-status.txt"
  run_rounds floor stoke-local-1 stoke-local-1-nosplit stoke-local-2 stoke-local-2-nosplit
}

run_scale() {
  local out="$BENCH_DIR/scale-results.txt"
  : >"$out"
  log "coordinator scale: lease -> commit cycles at ${BENCH_SCALE_WORKERS:-10,100,1000} workers"
  "$BIN/stoke-bench-scale" cycles --workers "${BENCH_SCALE_WORKERS:-10,100,1000}" \
    --seconds "${BENCH_SCALE_SECONDS:-10}" --work-dir "$BENCH_DIR/scale" | tee -a "$out"
  log "coordinator scale: 100 jobs of mixed priorities at 1000 workers, an urgent job half-way"
  # 20,000 shards a job: no job runs out within the run (jobs_done=0), so
  # all 100 share the workers to the end.
  "$BIN/stoke-bench-scale" cycles --workers 1000 --jobs 100 --shards 2000000 \
    --seconds "${BENCH_SCALE_SECONDS:-10}" --work-dir "$BENCH_DIR/scale" | tee -a "$out"
  # With cores to spare, the same runs again with the coordinator on cores
  # of its own, the simulated workers on the rest: on a small machine the
  # two share every core and the workers' CPU caps what the run can show.
  local ncpu coord_cpus
  ncpu=$(nproc)
  coord_cpus="${BENCH_SCALE_COORDINATOR_CPUS:-0-1}"
  if [ "$coord_cpus" != none ] && [ "$ncpu" -ge 4 ]; then
    local client_cpus="2-$((ncpu - 1))"
    [ -n "${BENCH_SCALE_COORDINATOR_CPUS:-}" ] && client_cpus="${BENCH_SCALE_CLIENT_CPUS:?set BENCH_SCALE_CLIENT_CPUS with BENCH_SCALE_COORDINATOR_CPUS}"
    for jobs in 1 100; do
      log "coordinator scale: $jobs job(s) at 1000 workers, the coordinator on CPUs $coord_cpus, the workers on $client_cpus"
      "$BIN/stoke-bench-scale" cycles --workers 1000 --jobs "$jobs" --shards $((jobs == 1 ? 400000 : 2000000)) \
        --seconds "${BENCH_SCALE_SECONDS:-10}" --work-dir "$BENCH_DIR/scale" \
        --coordinator-cpus "$coord_cpus" --client-cpus "$client_cpus" | tee -a "$out"
    done
  fi
  log "coordinator scale: the acquire path alone, 1 to 1000 jobs"
  "$BIN/stoke-bench-scale" acquire --jobs 1,10,100,1000 --workers 1000 | tee -a "$out"
  log "coordinator scale: the acquire path at 10 and 100 jobs with 10000 jobs ended before"
  "$BIN/stoke-bench-scale" acquire --jobs 10,100 --ended 10000 --workers 1000 | tee -a "$out"
  log "coordinator scale: plan ${BENCH_PLAN_SHARDS:-1000000} shards"
  "$BIN/stoke-bench-scale" plan --shards "${BENCH_PLAN_SHARDS:-1000000}" \
    --work-dir "$BENCH_DIR/scale" | tee -a "$out"
  log "coordinator scale: memory as 10 jobs of 30000 shards end one after another"
  "$BIN/stoke-bench-scale" ended --jobs 10 --shards 30000 \
    --work-dir "$BENCH_DIR/scale" | tee -a "$out"
  log "coordinator scale: commit latency while a ${BENCH_FINISH_SHARDS:-100000}-shard job finishes"
  "$BIN/stoke-bench-scale" finish --shards "${BENCH_FINISH_SHARDS:-100000}" \
    --work-dir "$BENCH_DIR/scale" | tee -a "$out"
  log "coordinator scale: a pipeline's 100000 intermediates in memory, against plain jobs"
  "$BIN/stoke-bench-scale" pipeline-memory --shards 100000 \
    --work-dir "$BENCH_DIR/scale" | tee -a "$out"
  rm -rf "$BENCH_DIR/scale"
  run_scale_deadline
}

# A job with a deadline and a budget against the state machine in process,
# on a paused clock (no coordinator process, seconds of real time): one line
# per seed and a summary with the targets, appended to the scale results.
run_scale_deadline() {
  local out="$BENCH_DIR/scale-results.txt"
  log "coordinator scale: a deadline and a budget, simulated, ${BENCH_DEADLINE_SEEDS:-20} seeds"
  "$BIN/stoke-bench-scale" deadline --seeds "${BENCH_DEADLINE_SEEDS:-20}" | tee -a "$out"
}

if [ "$what" = pt2 ] || [ "$what" = straggler-late ] || [ "$what" = link ] || [ "$what" = incremental ] || [ "$what" = scale-deadline ]; then
  # Only stoke runs here: the stoke venv has all the Python this needs
  # (torch to export the model, pyarrow to check outputs).
  BENCH_VENV="$STOKE_VENV"
else
  bench_venv
fi
BPY="$BENCH_VENV/bin/python"
BIN="$CARGO_TARGET_DIR/release"
build
# The shared libraries stoke's workers and the Python contenders' torch load.
mapfile -t WARM_LIBS < <(ldd "$BIN/stoke-worker" "$BENCH_VENV"/lib/python3*/site-packages/torch/_C*.so |
  awk '/=> \//{print $3}' | sort -u)
machine_info
case "$what" in
  all)
    rm -f "$BENCH_DIR/scale-results.txt"
    run_w1
    run_scale
    ;;
  w1)
    rm -f "$BENCH_DIR/scale-results.txt"
    run_w1
    ;;
  scale)
    rm -f "$BENCH_DIR/w1-results.jsonl"
    run_scale
    ;;
  scale-deadline)
    rm -f "$BENCH_DIR/w1-results.jsonl"
    : >"$BENCH_DIR/scale-results.txt"
    run_scale_deadline
    ;;
  pt2)
    rm -f "$BENCH_DIR/scale-results.txt"
    run_pt2
    ;;
  python)
    rm -f "$BENCH_DIR/scale-results.txt"
    run_python
    ;;
  split)
    rm -f "$BENCH_DIR/scale-results.txt"
    run_split
    ;;
  delta)
    rm -f "$BENCH_DIR/scale-results.txt"
    run_delta
    ;;
  iceberg)
    rm -f "$BENCH_DIR/scale-results.txt"
    run_iceberg
    ;;
  compare)
    rm -f "$BENCH_DIR/scale-results.txt"
    run_compare
    ;;
  ragged)
    "$BENCH_SRC/ragged.sh"
    exit 0
    ;;
  straggler)
    W1="$BENCH_DIR/w1"
    "$BPY" "$BENCH_SRC/w1_data.py" "$W1"
    model="$BENCH_DIR/straggler-model.pt"
    [ -f "$model" ] || "$BPY" "$BENCH_SRC/straggler.py" model "$model"
    # Half of W1 (4 files, 4 shards of 25,000): with the heavier model the
    # slowed worker alone takes about a minute.
    data="$BENCH_DIR/straggler-data"
    mkdir -p "$data"
    for i in 0 1 2 3; do ln -f "$W1/data/part-$i.parquet" "$data/part-$i.parquet"; done
    results="$BENCH_DIR/straggler-results.jsonl"
    rm -f "$results"
    mkdir -p "$BENCH_DIR/runs"
    log "straggler: 3 workers, one at a quarter of the others' speed, $RUNS rounds"
    for round in $(seq 1 "$RUNS"); do
      for c in solo-fast solo-slow split-off split-on ray; do
        case "$c" in
          solo-fast) args=(stoke "$BIN" "$data" "$model" "$BENCH_DIR/runs" --workers 1 --slow 0) ;;
          solo-slow) args=(stoke "$BIN" "$data" "$model" "$BENCH_DIR/runs" --workers 1 --slow 1) ;;
          split-off) args=(stoke "$BIN" "$data" "$model" "$BENCH_DIR/runs" --split off) ;;
          split-on) args=(stoke "$BIN" "$data" "$model" "$BENCH_DIR/runs" --split on) ;;
          ray)
            [ "${BENCH_RAY:-1}" = 0 ] && continue
            args=(ray "$data" "$model" "$BENCH_DIR/runs")
            ;;
        esac
        # The fast workers run half the time and the slow one an eighth (a
        # quarter of their speed): the fleet needs 1.1 of the 2 cores, so
        # the ideal (from each alone) is reachable on this machine.
        "$BPY" "$BENCH_SRC/straggler.py" "${args[@]}" --fast-duty 0.5 --duty 0.125 | tee -a "$results" ||
          log "straggler $c round $round failed"
      done
    done
    "$BPY" "$BENCH_SRC/straggler.py" summary "$results"
    exit 0
    ;;
  incremental)
    # Issue 35: a nightly job into a Delta table with `incremental = true`;
    # the re-run adds 1% new input (1 object of 100) to the first run's.
    W1="$BENCH_DIR/w1"
    "$BPY" "$BENCH_SRC/w1_data.py" "$W1"
    pool="$BENCH_DIR/incremental-pool"
    log "incremental: tiling W1 into ${BENCH_INCR_RECORDS:-2000000} records in 100 objects (if missing)"
    "$BPY" "$BENCH_SRC/incremental.py" data "$W1" "$pool" --records "${BENCH_INCR_RECORDS:-2000000}"
    results="$BENCH_DIR/incremental-results.jsonl"
    rm -f "$results"
    log "incremental: first run and re-run, run --local 2 and a fleet already up, $RUNS rounds"
    "$BPY" "$BENCH_SRC/incremental.py" run "$BIN" "$pool" "$W1/model.pt" "$BENCH_DIR/runs" "$results" --runs "$RUNS"
    "$BPY" "$BENCH_SRC/incremental.py" report "$results" | tee "$BENCH_DIR/incremental-report.md"
    exit 0
    ;;
  straggler-late)
    W1="$BENCH_DIR/w1"
    "$BPY" "$BENCH_SRC/w1_data.py" "$W1"
    model="$BENCH_DIR/straggler-model.pt"
    [ -f "$model" ] || "$BPY" "$BENCH_SRC/straggler.py" model "$model"
    # 36,000 of W1's records as JSON Lines, 2 files (a shard each): about
    # 3 s on 2 workers.
    data="$BENCH_DIR/straggler-jsonl"
    "$BPY" "$BENCH_SRC/straggler.py" jsonl "$W1/data" "$data"
    results="$BENCH_DIR/straggler-late-results.jsonl"
    rm -f "$results"
    mkdir -p "$BENCH_DIR/runs" "$BENCH_DIR/logs/straggler-late"
    runs="${BENCH_STRAGGLER_RUNS:-5}"
    log "straggler-late: 2 fast workers alone vs with a third slowed to a quarter, $runs rounds each way"
    # Two set-ups (BENCH_LATE_SETUPS): `budget` gives each worker a CPU
    # budget of its own, as on separate machines: the fast workers half a
    # core each (a cgroup quota each), the slow one a quarter of that.
    # `shared`: the fast workers run free and fill the 2 cores, the slow
    # one a quarter of the time (or of a core); there any third process,
    # even one never given work (the control), takes CPU from them.
    for setup in ${BENCH_LATE_SETUPS:-budget shared}; do
    case "$setup" in
      budget) fast=(--fast-by quota --fast-duty 0.5); duty=0.125 ;;
      # Issue 48's slow worker: it starts with the others and takes work,
      # then runs stopped 75 ms of every 100 (SIGSTOP; with a CPU quota,
      # from its start).
      shared) fast=(--cycle-ms "${BENCH_LATE_CYCLE_MS:-100}" --slow-from "${BENCH_LATE_SLOW_FROM:-registered}" --backup "${BENCH_LATE_BACKUP:-on}"); duty=0.25 ;;
      *) echo "BENCH_LATE_SETUPS: unknown set-up $setup (budget, shared)" >&2; exit 2 ;;
    esac
    for slow_by in ${BENCH_LATE_SLOW_BY:-stop quota}; do
      for round in $(seq 1 "$runs"); do
        # Without the slow worker, with it, and the control (the same
        # third process, never given work) take turns, the first of a
        # round rotating, so a drift in the machine's speed hits all alike.
        case $((round % 3)) in
          1) order="without with control" ;;
          2) order="with control without" ;;
          0) order="control without with" ;;
        esac
        for c in $order; do
          case "$c" in
            without) args=(--workers 2 --slow 0) ;;
            with) args=(--workers 3 --slow 1) ;;
            control) args=(--workers 3 --slow 1 --control) ;;
          esac
          "$BPY" "$BENCH_SRC/straggler.py" stoke "$BIN" "$data" "$model" "$BENCH_DIR/runs" \
            "${args[@]}" "${fast[@]}" --format jsonl --start after-submit --slow-by "$slow_by" --duty "$duty" \
            --round "$round" --keep-log "$BENCH_DIR/logs/straggler-late/$setup-$slow_by-$c-r$round.txt" |
            tee -a "$results" || log "straggler-late $setup $slow_by $c round $round failed"
        done
      done
    done
    done
    "$BPY" "$BENCH_SRC/straggler.py" ratios "$results"
    exit 0
    ;;
  link)
    W1="$BENCH_DIR/w1"
    "$BPY" "$BENCH_SRC/w1_data.py" "$W1"
    slow_model="$BENCH_DIR/straggler-model.pt"
    [ -f "$slow_model" ] || "$BPY" "$BENCH_SRC/straggler.py" model "$slow_model"
    results="$BENCH_DIR/link-results.jsonl"
    : >"$results"
    mkdir -p "$BENCH_DIR/runs"
    delays=(0 50 200)
    log "link: W1's data on one worker, 0/50/200 ms each way to the coordinator, $RUNS rounds"
    for round in $(seq 1 "$RUNS"); do
      # The slow model at the default interval (the target) and at 5; W1's
      # own model at the default interval.
      for case in "slow 100" "slow 5" "w1 100"; do
        read -r label interval <<<"$case"
        model_args=()
        [ "$label" = slow ] && model_args=(--model "$slow_model" --label slow)
        for i in 0 1 2; do
          # The order turns each round: drift falls on every delay alike.
          delay="${delays[$(((i + round - 1) % 3))]}"
          "$BPY" "$BENCH_SRC/link.py" run "$BIN" "$W1" "$BENCH_DIR/runs" "${model_args[@]}" \
            --delay-ms "$delay" --interval "$interval" --round "$round" | tee -a "$results" ||
            log "link $label $delay ms interval $interval round $round failed"
        done
      done
    done
    "$BPY" "$BENCH_SRC/link.py" summary "$results" | tee "$BENCH_DIR/link.md"
    exit 0
    ;;
  s3)
    W1="$BENCH_DIR/w1"
    "$BPY" "$BENCH_SRC/w1_data.py" "$W1"
    "$STOKE_REPO/scripts/s3-server.sh" >/dev/null
    log "W1 on file:// vs S3 (s3s-fs on loopback, through a counting proxy), $RUNS rounds"
    (cd "$STOKE_REPO" && STOKE_W1_DIR="$W1" BENCH_RUNS="$RUNS" \
      cargo test --release -q -p stoke-tests --test bench_s3 -- --ignored --nocapture --test-threads=1) |
      grep '^{' | tee "$BENCH_DIR/s3-results.jsonl"
    exit 0
    ;;
esac
if [ "$what" = all ]; then
  "$BENCH_SRC/ragged.sh" >"$BENCH_DIR/ragged.md"
fi

took=$SECONDS
report="$BENCH_DIR/report.md"
{
  echo "# stoke benchmarks"
  echo
  echo "Command: \`bench/run.sh $what\` (W1 runs per contender: $RUNS); took ${took} s on this machine;"
  echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)."
  echo
  "$BPY" "$BENCH_SRC/report.py" "$BENCH_DIR"
  if [ "$what" = all ] && [ -f "$BENCH_DIR/ragged.md" ]; then
    cat "$BENCH_DIR/ragged.md"
  fi
} >"$report"
cat "$report"
log "report written to $report"
