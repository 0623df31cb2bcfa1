#!/usr/bin/env bash
# The LLM lane against Ray Data's LLM API (issue #46): `ray.data.llm`
# (Ray 2.60.0) over bench/llm.py's prompts, with its engine settings, on the
# tiny random-weight Llama, beside vLLM's offline `LLM.generate` (see
# bench/ray_llm.py). Sets up the engine venv, the Ray venv over it
# (scripts/ray-llm-venv.sh) and the model, all cached in ~/.cache/stoke,
# and prints the figures. stoke's own figure is bench/llm.sh's job phase:
# run it right after, on the same machine state.
#
#   bench/ray_llm.sh [PROMPTS] [bench/ray_llm.py options]   # default 5000
#   bench/ray_llm.sh 5000 && bench/llm.sh 5000 1
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/env.sh"
cd "$STOKE_REPO"
llm_python="$(scripts/llm-venv.sh)"
ray_python="$(scripts/ray-llm-venv.sh)"
"$llm_python" scripts/llm_fixture.py "$STOKE_CACHE/llm-fixture" >/dev/null
prompts="${1:-5000}"
shift || true
"$ray_python" bench/ray_llm.py --llm-python "$llm_python" --model "$STOKE_CACHE/llm-fixture/model" \
  --reference scripts/llm_reference.py --work "$STOKE_CACHE/bench/ray-llm" --prompts "$prompts" "$@"
