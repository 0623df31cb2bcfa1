#!/usr/bin/env bash
# Builds the container images (deploy/images/*.Dockerfile) from the release
# wheels and runs a real job through them (issue 60); scripts/long.sh runs it
# (suite `image`). Needs root (debootstrap, buildah's chroot isolation).
#
#   scripts/image.sh          # base, images, a job through 2 image workers, sizes
#   scripts/image.sh --base   # only the stand-in base image (cached)
#
# 1. No base image can be pulled on these machines, so a local stand-in for
#    the Dockerfiles' default base, python:3.11-slim-bookworm, is made with
#    Debian's debootstrap (bookworm, minbase, python3, python3-venv,
#    libpython3.11 (the official image ships a shared libpython, which
#    stoke-worker links; Debian's python3 does not bring it), ca-certificates),
#    cached as a tarball in ~/.cache/stoke/images/, and imported into
#    buildah's storage under that name.
# 2. The release wheels (scripts/python-package.sh --release) and a
#    wheelhouse of their dependencies (torch 2.11.0 and its CUDA libraries,
#    numpy, pyarrow, cloudpickle; pip download, cached in
#    ~/.cache/stoke/images/wheelhouse) go to the builds, which install with
#    PIP_ARGS="--no-index --find-links /wheelhouse": nothing is fetched
#    inside a build.
# 3. `buildah bud --isolation chroot` builds stoke-coordinator:0.1.0 and
#    stoke-worker:0.1.0 (the names the Kustomize bases use), with the base
#    image as the PYTHON_IMAGE build argument.
# 4. A job: the coordinator from its image and 2 workers from the worker
#    image, each `buildah run --isolation chroot --network host` (so each
#    worker is the image's own Python, wheel and libraries), the job
#    submitted with the coordinator image's `stoke`; the book's first job
#    (a .pt2 model, the demo's digits), then its outputs checked: every
#    record exactly once. The job's folder is mounted at the same path in
#    every container, and the coordinator runs as the workers' uid (10001)
#    so both write the one file root (a cluster shares an object store).
# 5. Prints each image's size and ends with `image: ok (...)`.
#
# (Podman cannot start containers here: crun's setrlimit is refused;
# buildah's chroot isolation needs none.)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

base_only=0
for arg in "$@"; do
  case "$arg" in
    --base) base_only=1 ;;
    *) echo "image.sh: unknown argument $arg (--base)" >&2; exit 2 ;;
  esac
done

started=$(date +%s)
log() { echo "image: $*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root (debootstrap and buildah's chroot isolation need it)"

if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
  log "installing buildah and debootstrap (Debian packages)"
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends buildah debootstrap >&2
fi

images="$STOKE_CACHE/images"
mkdir -p "$images"
base_name="docker.io/library/python:3.11-slim-bookworm"
base_packages="python3,python3-venv,libpython3.11,ca-certificates"
base_key="bookworm minbase $base_packages v1"
base_tar="$images/bookworm-python.tar"

# The Debian mirror apt uses here.
mirror() {
  local uri
  uri=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -n1 || true)
  [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# The stand-in base: a debootstrap tarball (made once), imported as
# $base_name when buildah's storage lacks it or holds an older one.
make_base() {
  if [ ! -f "$base_tar" ] || [ "$(cat "$base_tar.key" 2>/dev/null)" != "$base_key" ]; then
    log "debootstrap bookworm ($base_packages) from $(mirror) (first time: about 3 minutes)"
    local root="$images/rootfs.tmp"
    rm -rf "$root"
    debootstrap --variant=minbase --include="$base_packages" bookworm "$root" "$(mirror)" >"$images/debootstrap.log" 2>&1 \
      || fail "debootstrap (see $images/debootstrap.log)"
    # As the python images: apt's lists and caches dropped.
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
    tar -C "$root" -cf "$base_tar.tmp" .
    rm -rf "$root"
    mv "$base_tar.tmp" "$base_tar"
    echo "$base_key" >"$base_tar.key"
  fi
  local label
  label=$(buildah inspect --type image --format '{{index .ImageAnnotations "stoke.base-key"}}' "$base_name" 2>/dev/null || true)
  if [ "$label" != "$base_key" ]; then
    log "importing the stand-in base as $base_name"
    local ctr mnt
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    tar -C "$mnt" -xf "$base_tar"
    buildah umount "$ctr" >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
      --cmd python3 --annotation "stoke.base-key=$base_key" "$ctr"
    buildah commit --rm -q "$ctr" "$base_name" >/dev/null
  fi
}

make_base
if [ "$base_only" = 1 ]; then
  log "base ready: $base_name"
  exit 0
fi

wheel="$(scripts/python-package.sh --release --no-install --wheel)"
client_wheel="$(scripts/python-package.sh --release --no-install --client-wheel)"

# The dependencies' wheels, as pip resolves them here: CPython 3.11 on
# Linux x86-64 with glibc 2.36, as in the base (bookworm).
reqs="torch==2.11.0 numpy pyarrow cloudpickle"
wheelhouse="$images/wheelhouse"
if [ "$(cat "$wheelhouse/.stoke-reqs" 2>/dev/null)" != "$reqs" ]; then
  log "downloading the images' dependencies into $wheelhouse (pip's cache: ~/.cache/stoke/pip)"
  rm -rf "$wheelhouse"
  # shellcheck disable=SC2086
  PIP_CACHE_DIR="$STOKE_CACHE/pip" pip download -q --dest "$wheelhouse" --only-binary :all: $reqs >&2
  echo "$reqs" >"$wheelhouse/.stoke-reqs"
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/stoke-image.XXXXXX")"
containers=()
pids=()
cleanup() {
  local pid ctr
  for pid in "${pids[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  for ctr in "${containers[@]}"; do
    buildah rm "$ctr" >/dev/null 2>&1 || true
  done
  # The images this run's builds untagged (the previous run's).
  buildah rmi --prune >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

context="$work/context"
mkdir -p "$context"
cp "$wheel" "$client_wheel" "$context/"

build() {
  local name="$1" dockerfile="$2" t0
  t0=$(date +%s)
  log "buildah bud $dockerfile -> $name"
  buildah bud --isolation chroot -q -f "$dockerfile" \
    --build-arg PYTHON_IMAGE="$base_name" \
    --build-arg PIP_ARGS="--no-index --find-links /wheelhouse" \
    --volume "$wheelhouse:/wheelhouse:ro" \
    -t "$name" "$context" >"$work/build-$(basename "$dockerfile").log" 2>&1 \
    || fail "building $name: $(tail -n 30 "$work/build-$(basename "$dockerfile").log")"
  log "built $name in $(($(date +%s) - t0))s"
}
build localhost/stoke-coordinator:0.1.0 deploy/images/coordinator.Dockerfile
build localhost/stoke-worker:0.1.0 deploy/images/worker.Dockerfile
# What the stages left behind.
buildah rmi --prune >/dev/null 2>&1 || true

# The job: the book's first job on the demo's digits and .pt2 model.
assets="$STOKE_CACHE/demo"
python scripts/demo_assets.py "$assets" >&2
job_dir="$work/job"
mkdir -p "$job_dir/state"
cp -r "$assets/digits" "$assets/model.pt2" "$job_dir/"
cat >"$job_dir/my-job.toml" <<'EOF'
name = "image-digits"

[dataset]
format = "parquet"
uri = "digits/"
id_column = "id"

[processor]
name = "pytorch"

[processor.params]
model = "model.pt2"
input_column = "pixels"
outputs = ["argmax", "scores"]

[batching]
batch_size = 64

[checkpoint]
interval = 4

[sharding]
records = 256
EOF
chown -R 10001:10001 "$job_dir"
chmod 755 "$work"

# A working container of an image, in $ctr, removed at exit (set here,
# not printed: a command substitution's subshell would lose the list).
container() {
  ctr=$(buildah from "$1")
  containers+=("$ctr")
}

port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
addr="http://127.0.0.1:$port"
run=(buildah run --isolation chroot --network host -v "$job_dir:$job_dir" --workingdir "$job_dir")
container localhost/stoke-coordinator:0.1.0
coordinator="$ctr"
setsid "${run[@]}" --user 10001:10001 "$coordinator" -- \
  stoke-coordinator --listen "127.0.0.1:$port" --http-listen off --root "$job_dir/state" >"$work/coordinator.log" 2>&1 &
pids+=($!)
deadline=$(($(date +%s) + 60))
until "${run[@]}" "$coordinator" -- stoke --coordinator "$addr" jobs >/dev/null 2>&1; do
  [ "$(date +%s)" -lt "$deadline" ] || fail "the coordinator did not answer within 60s: $(cat "$work/coordinator.log")"
  sleep 0.5
done
"${run[@]}" "$coordinator" -- stoke --coordinator "$addr" submit my-job.toml --job-id image-digits >/dev/null \
  || fail "stoke submit (coordinator image)"
for w in 1 2; do
  container localhost/stoke-worker:0.1.0
  setsid "${run[@]}" "$ctr" -- \
    stoke-worker --coordinator "$addr" --worker-id "image-w$w" --device cpu >"$work/worker-$w.log" 2>&1 &
  pids+=($!)
done
t0=$(date +%s)
"${run[@]}" "$coordinator" -- stoke --coordinator "$addr" status image-digits --watch >"$work/watch.txt" 2>/dev/null \
  || fail "the job: $(cat "$work/watch.txt") $(tail -n 20 "$work/worker-1.log")"
job_s=$(($(date +%s) - t0))
grep -q '^state: succeeded' "$work/watch.txt" || fail "the job did not succeed: $(cat "$work/watch.txt")"
python scripts/wheel_check.py "$job_dir/state/jobs/image-digits/outputs" "$assets/digits" >&2 \
  || fail "the job's outputs"
# Both image workers ran part of it (the report's per-worker devices).
"${run[@]}" "$coordinator" -- stoke --coordinator "$addr" report image-digits --json >"$work/report.json" \
  || fail "stoke report (coordinator image)"
for w in 1 2; do
  grep -q "image-w$w" "$work/report.json" || fail "worker image-w$w took no part: $(cat "$work/report.json")"
done

sizes=$(buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E 'stoke-(coordinator|worker)|python' | sort)
log "images:"
echo "$sizes" | sed 's/^/  /' >&2
summary=$(echo "$sizes" | awk '{ sub(".*/", "", $1); printf "%s%s %s %s", sep, $1, $2, $3; sep = ", " }')
echo "image: ok ($(($(date +%s) - started))s; job through 2 image workers in ${job_s}s, 1797 records exactly once; $summary)"
