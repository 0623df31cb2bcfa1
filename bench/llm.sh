#!/usr/bin/env bash
# The LLM lane's benchmark: stoke `run --local 1` vs vLLM's offline
# `LLM.generate`, 5,000 prompts on the tiny random-weight Llama (see
# bench/llm.py). Sets up the engine venv and the model (cached in
# ~/.cache/stoke), builds the release binaries (as users run them, and as
# the other benchmarks do), prints the figures.
#
#   bench/llm.sh [PROMPTS] [RUNS]     # defaults 5000 1
#   BENCH_LLM_SCENARIO=prefix bench/llm.sh 2000 3
#                                     # the shared-prefix workload:
#                                     # group_by_prefix true vs false
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$STOKE_REPO"
llm_python="$(scripts/llm-venv.sh)"
"$llm_python" scripts/llm_fixture.py "$STOKE_CACHE/llm-fixture" >/dev/null
echo "building stoke (release)" >&2
cargo build --release -q -p stoke-cli -p stoke-worker -p stoke-coordinator
python bench/llm.py --llm-python "$llm_python" --model "$STOKE_CACHE/llm-fixture/model" \
  --stoke "$CARGO_TARGET_DIR/release/stoke" --reference scripts/llm_reference.py \
  --work "$STOKE_CACHE/bench/llm" --prompts "${1:-5000}" --runs "${2:-1}" \
  --scenario "${BENCH_LLM_SCENARIO:-plain}"
