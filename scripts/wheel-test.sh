#!/usr/bin/env bash
# `pip install stoke`, tested the way a user meets it (issue 60): the release
# wheels, installed into fresh venvs with no Rust toolchain on PATH and no
# source tree on sys.path, run real jobs; every record is checked to be
# committed exactly once. scripts/long.sh runs it (suite `wheel`).
#
#   scripts/wheel-test.sh          # everything below
#   scripts/wheel-test.sh --llm    # ... and an LLM job (sets up the engine venv,
#                                  #     scripts/llm-venv.sh, the first time: minutes)
#
# 1. Builds the release wheels (scripts/python-package.sh --release; cached).
# 2. The full install: a fresh venv, `pip install` of the stoke wheel,
#    which pulls stoke-client (the other wheel) and torch 2.11.0 from the
#    registry (pip's cache: ~/.cache/stoke/pip). Measured: the download,
#    the time, the installed size.
#    - the book's first job (docs/src/getting-started/first-job.md), as
#      written, with `stoke run --local 2`: the built-in processor on the
#      demo's .pt2 model (scripts/demo_assets.py);
#    - a coordinator and 2 workers started as separate commands from the
#      venv's bin, running the book's Python processor (a TorchScript model,
#      in the workers' embedded CPython: the venv's own Python);
#    - `stoke run --embedded` (stoke-embedded, bundled beside stoke);
#    - stoke.torch_batch_process with a torch Dataset, in process and on
#      2 local workers;
#    - with --llm, an LLM job (`[llm] python` = the engine venv).
# 3. The client-only install: a fresh venv, `pip install` of the
#    stoke-client wheel alone: no torch in `pip list`; its `stoke submit`,
#    `status --watch`, `set`, `cancel`, `report` and `stoke.Client` drive the
#    coordinator of step 2.
#
# Ends with one line: `wheel-test: ok (...)` with the sizes and times, or
# exits 1 naming what failed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

llm=0
for arg in "$@"; do
  case "$arg" in
    --llm) llm=1 ;;
    *) echo "wheel-test.sh: unknown argument $arg (--llm)" >&2; exit 2 ;;
  esac
done

started=$(date +%s)
log() { echo "wheel-test: $*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.0f MiB", b / 1048576 }'; }

wheel="$(scripts/python-package.sh --release --no-install --wheel)"
client_wheel="$(scripts/python-package.sh --release --no-install --client-wheel)"
wheel_dir="$(dirname "$wheel")"
log "wheels: $(basename "$wheel") ($(mib "$(stat -c %s "$wheel")")), $(basename "$client_wheel") ($(mib "$(stat -c %s "$client_wheel")"))"

# The demo's inputs (the book's first job runs on them), made with the stoke
# venv: the user's venv needs none of what makes them.
assets="$STOKE_CACHE/demo"
python scripts/demo_assets.py "$assets" >&2

work="$(mktemp -d "${TMPDIR:-/tmp}/stoke-wheel-test.XXXXXX")"
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

# The interpreter venvs are made from (the one under the stoke venv).
base_python="$(python -c 'import os, sys; print(os.path.realpath(sys._base_executable))')"
pip_cache="$STOKE_CACHE/pip"

# The environment of a user of the venv $1: its bin first on PATH, then the
# system's, so no cargo, rustc or stoke build is reachable, and none of the
# repository's settings (into the array env_args).
user_env() {
  env_args=(-u CARGO_TARGET_DIR -u LIBTORCH_USE_PYTORCH -u STOKE_BIN_DIR -u STOKE_VENV -u STOKE_REPO
    -u STOKE_CACHE -u VIRTUAL_ENV -u PYTHONPATH -u STOKE_PYTHON -u LD_LIBRARY_PATH
    -u STOKE_COORDINATOR -u STOKE_LLM_PYTHON -u STOKE_WORKER_BIN
    PATH="$1/bin:/usr/local/bin:/usr/bin:/bin" PIP_CACHE_DIR="$pip_cache" PIP_DISABLE_PIP_VERSION_CHECK=1)
}

# Runs a command as that user.
as_user() {
  local venv="$1"
  shift
  user_env "$venv"
  env "${env_args[@]}" "$@"
}

# Starts a command as that user in the background, in folder $3, its
# output in the file $1; its process id (the command's own: each step
# execs the next) goes to pids.
spawn() {
  local log="$1" venv="$2" dir="$3"
  shift 3
  user_env "$venv"
  (cd "$dir" && exec env "${env_args[@]}" "$@") >"$log" 2>&1 &
  pids+=($!)
}

# Waits for a command to succeed, up to $2 seconds.
wait_until() {
  local what="$1" deadline=$(($(date +%s) + $2))
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "timed out waiting for $what"
    sleep 0.2
  done
}

# Makes a fresh venv at $1 and installs the wheel $2 into it, the way a user
# does (`pip install` of the wheel; its dependencies from the registry).
# The download (pip download into a folder, from pip's cache when warm) is
# measured on its own. Prints "download_bytes install_s installed_bytes".
install_venv() {
  local venv="$1" what="$2" dl
  dl="$work/download-$(basename "$1")"
  "$base_python" -m venv "$venv"
  local bare t0 t1
  bare=$(du -sb "$venv" | cut -f1)
  as_user "$venv" pip download -q --dest "$dl" --find-links "$wheel_dir" "$what" >&2
  t0=$(date +%s.%N)
  as_user "$venv" pip install -q --no-index --find-links "$dl" "$what" >&2
  t1=$(date +%s.%N)
  echo "$(du -sb "$dl" | cut -f1) $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }') $(($(du -sb "$venv" | cut -f1) - bare))"
  rm -rf "$dl"
}

full="$work/full"
client="$work/client"
log "installing the stoke wheel into a fresh venv (torch from the registry)"
read -r full_dl full_s full_size < <(install_venv "$full" "$wheel")
log "installing the stoke-client wheel alone into another"
read -r client_dl client_s client_size < <(install_venv "$client" "$client_wheel")

# No toolchain, no source tree.
as_user "$full" bash -c '! command -v cargo && ! command -v rustc' >/dev/null || fail "cargo or rustc is on the user's PATH"
for cmd in stoke stoke-coordinator stoke-worker; do
  [ -x "$full/bin/$cmd" ] || fail "the full install has no $cmd in its bin"
done
for cmd in stoke stoke-coordinator; do
  [ -x "$client/bin/$cmd" ] || fail "the client install has no $cmd in its bin"
done
[ ! -e "$client/bin/stoke-worker" ] || fail "the client install has stoke-worker"
(cd "$work" && as_user "$full" python - "$STOKE_REPO" <<'PY') || fail "the full install's stoke package"
import os, sys
repo = sys.argv[1]
import stoke, torch
assert not stoke.__file__.startswith(repo), stoke.__file__
assert not any(p.startswith(repo) for p in sys.path if p), sys.path
assert torch.__version__.split("+")[0] == "2.11.0", torch.__version__
from stoke import TorchBatchProcessor, Client, StokeError, torch_batch_process  # noqa: F401
PY
as_user "$client" pip list --format=freeze >"$work/client-pip-list.txt"
if grep -Eiq '^(torch|nvidia-|numpy|pyarrow)' "$work/client-pip-list.txt"; then
  fail "the client-only install has torch or its company: $(tr '\n' ' ' <"$work/client-pip-list.txt")"
fi
(cd "$work" && as_user "$client" python - <<'PY') || fail "the client install's stoke package"
import importlib.util, sys
import stoke
assert importlib.util.find_spec("torch") is None
stoke.Client, stoke.StokeError  # noqa: B018
try:
    stoke.TorchBatchProcessor
except ImportError as e:
    assert "pip install stoke" in str(e), e
else:
    raise AssertionError("a client-only install has the processor API")
assert "torch" not in sys.modules
PY
# `stoke run` needs the worker side, which the client-only install lacks:
# it says how to get it.
(cd "$work" && as_user "$client" stoke run --local 1 --root "$work/no-worker" "$assets/digits.toml" 2>&1 || true) | grep -q "pip install stoke" \
  || fail "stoke run in the client-only install does not say to pip install stoke"
# The same binaries as cargo's: the launchers exec them, so --version is theirs.
as_user "$full" stoke --version | grep -q '^stoke ' || fail "stoke --version"
as_user "$full" stoke-worker --help >/dev/null || fail "stoke-worker --help"
as_user "$client" stoke-coordinator --help >/dev/null || fail "stoke-coordinator --help (client install)"

# 1. The book's first job, as written, with `stoke run --local 2`.
log "the book's first job: stoke run --local 2"
first="$work/first"
mkdir -p "$first"
ln -s "$assets/digits" "$first/digits"
ln -s "$assets/model.pt2" "$first/model.pt2"
cat >"$first/my-job.toml" <<'EOF'
name = "my-digits"

[dataset]
format = "parquet"
uri = "digits/"                   # relative to this file
id_column = "id"

[processor]
name = "pytorch"                  # the built-in runner: a .pt2 package or TorchScript

[processor.params]
model = "model.pt2"               # checked at submit: a typo fails at once
input_column = "pixels"
outputs = ["argmax", "scores"]    # columns `prediction` and `scores`

[batching]
batch_size = 64

[checkpoint]
interval = 4                      # commit every 4 batches (and at each shard's end)

[sharding]
records = 256                     # about 8 shards, so 2 workers share them
EOF
t0=$(date +%s.%N)
(cd "$first" && as_user "$full" stoke run --local 2 --device cpu --root ./my-state my-job.toml) >"$first/summary.txt" \
  || fail "stoke run --local 2 (summary: $(cat "$first/summary.txt"))"
first_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
job=$(sed -n 's/^job: //p' "$first/summary.txt")
grep -q '^state: succeeded' "$first/summary.txt" || fail "the first job did not succeed: $(cat "$first/summary.txt")"
python scripts/wheel_check.py "$first/my-state/jobs/$job/outputs" "$assets/digits" >&2 || fail "the first job's outputs"

# 2. `stoke run --embedded`: stoke-embedded, found beside stoke.
log "stoke run --embedded"
(cd "$first" && as_user "$full" stoke run --embedded --device cpu --root ./embedded-state --job-id embedded my-job.toml) \
  >"$first/embedded.txt" || fail "stoke run --embedded: $(cat "$first/embedded.txt")"
python scripts/wheel_check.py "$first/embedded-state/jobs/embedded/outputs" "$assets/digits" >&2 || fail "the embedded job's outputs"

# 3. A coordinator and 2 workers, each its own command from the venv's bin;
# jobs submitted and followed from the client-only install.
log "a coordinator and 2 workers from the venv's bin; the client install submits"
cluster="$work/cluster"
mkdir -p "$cluster"
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
addr="http://127.0.0.1:$port"
spawn "$cluster/coordinator.log" "$full" "$cluster" \
  stoke-coordinator --listen "127.0.0.1:$port" --http-listen off --root "$cluster/state"
wait_until "the coordinator ($addr)" 60 as_user "$client" stoke --coordinator "$addr" jobs
ln -s "$assets/digits" "$cluster/digits"
cp scripts/book_processor.py "$cluster/my_processor.py"
cat >"$cluster/job.toml" <<EOF
name = "python-digits"

[dataset]
format = "parquet"
uri = "digits/"
id_column = "id"

[processor]
python = "my_processor:InferenceProcessor"
python_path = ["."]

[processor.params]
model = "$assets/model.pt"

[batching]
batch_size = 64

[sharding]
records = 256
EOF
c() { (cd "$cluster" && as_user "$client" stoke --coordinator "$addr" "$@"); }
# Verbs on a job no worker has taken yet: set, then cancel.
c submit job.toml --job-id to-cancel >/dev/null || fail "stoke submit (client install)"
c set to-cancel --priority 5 >/dev/null || fail "stoke set (client install)"
c cancel to-cancel >/dev/null || fail "stoke cancel (client install)"
c status to-cancel --json | grep -q '"state": *"cancelled"' || fail "the cancelled job: $(c status to-cancel --json)"
c submit job.toml --job-id python-digits >/dev/null || fail "stoke submit (client install)"
for w in 1 2; do
  spawn "$cluster/worker-$w.log" "$full" "$cluster" stoke-worker --coordinator "$addr" --worker-id "w$w" --device cpu
done
t0=$(date +%s.%N)
c status python-digits --watch >"$cluster/watch.txt" 2>"$cluster/watch.err" \
  || fail "stoke status --watch (client install): $(cat "$cluster/watch.txt" "$cluster/watch.err")"
cluster_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
grep -q '^state: succeeded' "$cluster/watch.txt" || fail "the Python processor job: $(cat "$cluster/watch.txt")"
c report python-digits >/dev/null || fail "stoke report (client install)"
python scripts/wheel_check.py "$cluster/state/jobs/python-digits/outputs" "$assets/digits" >&2 || fail "the cluster job's outputs"
(cd "$work" && as_user "$client" python - "$addr" <<'PY') || fail "stoke.Client (client install)"
import sys
import stoke
client = stoke.Client(sys.argv[1])
job = client.status("python-digits")
assert job["state"] == "succeeded" and job["records_done"] == 1797, job
assert {j["job_id"] for j in client.jobs()} >= {"python-digits", "to-cancel"}
try:
    client.status("no-such-job")
except stoke.StokeError as e:
    assert "no-such-job" in str(e), e
else:
    raise AssertionError("no StokeError for an unknown job")
PY

# 4. The Python API from the full install: torch_batch_process with a torch
# Dataset, in this process and on 2 local worker processes (python -m
# stoke._worker against a coordinator in the calling process).
log "torch_batch_process, in process and with workers=2"
(cd "$work" && as_user "$full" python - "$work/tbp" <<'PY') || fail "torch_batch_process (full install)"
import sys
import torch
from torch.utils.data import Dataset
import pyarrow.dataset as ds
from stoke import TorchBatchProcessor, torch_batch_process

class Squares(Dataset):
    def __len__(self):
        return 300
    def __getitem__(self, i):
        return torch.tensor([float(i)]), i * i

class Recorder(TorchBatchProcessor):
    def __init__(self, context):
        self.context = context
    def process_batch(self, batch, batch_idx):
        self.context.write_rows({"id": batch.ids, "square": batch[1]})

if __name__ == "__main__":
    for workers in (0, 2):
        root = f"{sys.argv[1]}/{workers}"
        report = torch_batch_process(Recorder, Squares(), batch_size=16, root=root, job_id=f"w{workers}",
                                     workers=workers, device="cpu", shard_records=64)
        ids = ds.dataset(f"{root}/jobs/w{workers}/outputs", format="parquet").to_table(columns=["id"]).column("id").to_pylist()
        assert report["records"] == 300 and sorted(ids, key=int) == [str(i) for i in range(300)], (workers, report, len(ids))
PY

# 5. An LLM job: the engine in its own venv, `[llm] python`.
llm_note="llm: not run (--llm)"
if [ "$llm" = 1 ]; then
  log "an LLM job ([llm] python = the engine venv)"
  llm_python="$(scripts/llm-venv.sh)"
  "$llm_python" scripts/llm_fixture.py "$STOKE_CACHE/llm-fixture" >&2
  llm_dir="$work/llm"
  mkdir -p "$llm_dir/prompts"
  python - "$llm_dir/prompts/part-0.parquet" <<'PY'
import sys
import pyarrow as pa, pyarrow.parquet as pq
ids = [f"p-{i:03d}" for i in range(40)]
prompts = [f"tell me about number {i}" for i in range(40)]
pq.write_table(pa.table({"id": ids, "prompt": prompts}), sys.argv[1], row_group_size=10)
PY
  cat >"$llm_dir/llm.toml" <<EOF
name = "llm-wheel"

[dataset]
format = "parquet"
uri = "prompts/"
id_column = "id"

[processor]
name = "llm"

[processor.params]
model = "$STOKE_CACHE/llm-fixture/model"
task = "generate"
prompt_column = "prompt"
max_tokens = 8
temperature = 0.0
seed = 7

[llm]
python = "$llm_python"
# The tests' CPU settings (tests/tests/llm.rs): vLLM's CPU backend
# otherwise reserves 90% of the machine's memory for each engine.
engine_args = { max_model_len = 256, dtype = "float32", gpu_memory_utilization = 0.05, kv_cache_memory_bytes = 134217728, seed = 0 }
in_flight = 8

[sharding]
records = 20
EOF
  (cd "$llm_dir" && as_user "$full" env HF_HUB_OFFLINE=1 stoke run --local 2 --device cpu --root ./state --job-id llm llm.toml) \
    >"$llm_dir/summary.txt" || fail "the LLM job: $(cat "$llm_dir/summary.txt")"
  python scripts/wheel_check.py "$llm_dir/state/jobs/llm/outputs" "$llm_dir/prompts" >&2 || fail "the LLM job's outputs"
  llm_note="llm: 40 prompts exactly once"
fi

# The workers stop on SIGTERM, through the launcher (exec: same process).
for i in "${!pids[@]}"; do
  if [ "$i" -gt 0 ]; then
    kill -TERM "${pids[$i]}"
    wait "${pids[$i]}" || fail "worker $i exited $? on SIGTERM: $(tail -n 5 "$cluster/worker-$i.log")"
  fi
done
pids=("${pids[0]}")

log "full install: download $(mib "$full_dl"), install ${full_s}s (from the downloaded wheels), installed $(mib "$full_size")"
log "client install: download $(mib "$client_dl"), install ${client_s}s, installed $(mib "$client_size")"
echo "wheel-test: ok ($(($(date +%s) - started))s: stoke wheel $(mib "$(stat -c %s "$wheel")"), installed $(mib "$full_size") with torch, downloaded $(mib "$full_dl"); stoke-client wheel $(mib "$(stat -c %s "$client_wheel")"), installed $(mib "$client_size"); first job ${first_s}s, cluster job ${cluster_s}s; $llm_note)"
