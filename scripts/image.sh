#!/usr/bin/env bash
# Builds the container images (deploy/images/*.Dockerfile) from the release
# wheels and runs a real job through them (issue 60); scripts/long.sh runs it
# (suite `image`). Needs root (debootstrap, buildah's chroot isolation).
#
#   scripts/image.sh          # bases, images, two jobs through 3 image workers, sizes
#   scripts/image.sh --base   # only the stand-in base images (cached)
#
# 1. No base image can be pulled on these machines, so local stand-ins for
#    python:3.11-slim-bookworm (the Dockerfiles' default base) and
#    python:3.13-slim-trixie are made with Debian's debootstrap (minbase,
#    python3, python3-venv, ca-certificates: bookworm's python3 is 3.11,
#    trixie's 3.13), cached as tarballs in ~/.cache/stoke/images/, and
#    imported into buildah's storage under those names.
# 2. The release wheels (scripts/python-package.sh --release; the stoke
#    wheel is abi3, one for both) and a wheelhouse of their dependencies
#    for CPython 3.11 and 3.13 (torch 2.11.0 and its CUDA libraries, numpy,
#    pyarrow, cloudpickle; pip download, cached in
#    ~/.cache/stoke/images/wheelhouse) go to the builds, which install with
#    PIP_ARGS="--no-index --find-links /wheelhouse": nothing is fetched
#    inside a build.
# 3. `buildah bud --isolation chroot` builds stoke-coordinator:0.1.0 and
#    stoke-worker:0.1.0 (the names the Kustomize bases use) on the 3.11
#    base, and stoke-worker:0.1.0-python3.13 on the 3.13 one, the base
#    image as the PYTHON_IMAGE build argument.
# 4. Two jobs: the coordinator from its image and 3 workers, 2 from the
#    worker image and 1 from its 3.13 build, each `buildah run --isolation
#    chroot --network host` (so each worker is the image's own Python,
#    wheel and libraries), the jobs submitted with the coordinator image's
#    `stoke`: the book's first job (a .pt2 model, the demo's digits) and
#    its Python processor (a TorchScript model, in the workers' Python);
#    then the outputs checked: every record exactly once, and every worker
#    took part in each job. The job's folder is mounted at the same path in
#    every container, and the coordinator runs as the workers' uid (10001)
#    so all write the one file root (a cluster shares an object store).
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
base_packages="python3,python3-venv,ca-certificates"
# The stand-in bases: Debian release -> the image name it stands in for.
declare -A base_names=(
  [bookworm]="docker.io/library/python:3.11-slim-bookworm"
  [trixie]="docker.io/library/python:3.13-slim-trixie"
)

# The Debian mirror apt uses here.
mirror() {
  local uri
  uri=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | head -n1 || true)
  [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# A stand-in base: a debootstrap tarball of Debian release $1 (made once),
# imported as ${base_names[$1]} when buildah's storage lacks it or holds an
# older one.
make_base() {
  local suite="$1"
  local base_name="${base_names[$suite]}" base_key="$suite minbase $base_packages v2"
  local base_tar="$images/$suite-python.tar"
  if [ ! -f "$base_tar" ] || [ "$(cat "$base_tar.key" 2>/dev/null)" != "$base_key" ]; then
    log "debootstrap $suite ($base_packages) from $(mirror) (first time: about 3 minutes)"
    local root="$images/rootfs.tmp"
    rm -rf "$root"
    debootstrap --variant=minbase --include="$base_packages" "$suite" "$root" "$(mirror)" >"$images/debootstrap-$suite.log" 2>&1 \
      || fail "debootstrap $suite (see $images/debootstrap-$suite.log)"
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

make_base bookworm
make_base trixie
if [ "$base_only" = 1 ]; then
  log "bases ready: ${base_names[*]}"
  exit 0
fi

wheel="$(scripts/python-package.sh --release --no-install --wheel)"
client_wheel="$(scripts/python-package.sh --release --no-install --client-wheel)"

# The dependencies' wheels, as pip resolves them for CPython 3.11 and 3.13
# on Linux x86-64 (glibc 2.36 here, as in bookworm; trixie's is newer).
reqs="torch==2.11.0 numpy pyarrow cloudpickle"
pythons="3.11 3.13"
wheelhouse="$images/wheelhouse"
if [ "$(cat "$wheelhouse/.stoke-reqs" 2>/dev/null)" != "$reqs for $pythons" ]; then
  log "downloading the images' dependencies into $wheelhouse (pip's cache: ~/.cache/stoke/pip)"
  for version in $pythons; do
    # shellcheck disable=SC2086
    PIP_CACHE_DIR="$STOKE_CACHE/pip" pip download -q --dest "$wheelhouse" --only-binary :all: \
      --python-version "$version" $reqs >&2
  done
  echo "$reqs for $pythons" >"$wheelhouse/.stoke-reqs"
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
  local name="$1" dockerfile="$2" base="$3" t0
  t0=$(date +%s)
  log "buildah bud $dockerfile on $base -> $name"
  buildah bud --isolation chroot -q -f "$dockerfile" \
    --build-arg PYTHON_IMAGE="$base" \
    --build-arg PIP_ARGS="--no-index --find-links /wheelhouse" \
    --volume "$wheelhouse:/wheelhouse:ro" \
    -t "$name" "$context" >"$work/build-$(basename "$dockerfile").log" 2>&1 \
    || fail "building $name: $(tail -n 30 "$work/build-$(basename "$dockerfile").log")"
  log "built $name in $(($(date +%s) - t0))s"
  buildah rmi --prune >/dev/null 2>&1 || true
}
# The last run's images go first (every build here starts afresh: no layer
# cache), and what each build's stages left after it: three worker-sized
# images at once would not fit the disk.
buildah rmi -f localhost/stoke-coordinator:0.1.0 localhost/stoke-worker:0.1.0 \
  localhost/stoke-worker:0.1.0-python3.13 >/dev/null 2>&1 || true
buildah rmi --prune >/dev/null 2>&1 || true
build localhost/stoke-coordinator:0.1.0 deploy/images/coordinator.Dockerfile "${base_names[bookworm]}"
build localhost/stoke-worker:0.1.0 deploy/images/worker.Dockerfile "${base_names[bookworm]}"
build localhost/stoke-worker:0.1.0-python3.13 deploy/images/worker.Dockerfile "${base_names[trixie]}"

# The jobs: the book's first job on the demo's digits and .pt2 model, and
# its Python processor (a TorchScript model) on the same data.
assets="$STOKE_CACHE/demo"
python scripts/demo_assets.py "$assets" >&2
job_dir="$work/job"
mkdir -p "$job_dir/state"
cp -r "$assets/digits" "$assets/model.pt2" "$assets/model.pt" "$job_dir/"
cat >"$job_dir/pt2-job.toml" <<'TOML'
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
TOML
cp scripts/book_processor.py "$job_dir/my_processor.py"
cat >"$job_dir/python-job.toml" <<TOML
name = "image-python-digits"

[dataset]
format = "parquet"
uri = "digits/"
id_column = "id"

[processor]
python = "my_processor:InferenceProcessor"
python_path = ["."]

[processor.params]
model = "$job_dir/model.pt"

[batching]
batch_size = 64

[sharding]
records = 128
TOML
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
stoke_c() { "${run[@]}" "$coordinator" -- stoke --coordinator "$addr" "$@"; }
stoke_c submit pt2-job.toml --job-id image-digits >/dev/null || fail "stoke submit (coordinator image)"
stoke_c submit python-job.toml --job-id image-python-digits >/dev/null || fail "stoke submit (coordinator image)"
# 2 workers from the worker image (CPython 3.11), 1 from its 3.13 build.
declare -A worker_image=(
  [1]=localhost/stoke-worker:0.1.0
  [2]=localhost/stoke-worker:0.1.0
  [3]=localhost/stoke-worker:0.1.0-python3.13
)
declare -A worker_ctr=()
for w in 1 2 3; do
  container "${worker_image[$w]}"
  worker_ctr[$w]="$ctr"
  setsid "${run[@]}" "$ctr" -- \
    stoke-worker --coordinator "$addr" --worker-id "image-w$w" --device cpu >"$work/worker-$w.log" 2>&1 &
  pids+=($!)
done
t0=$(date +%s)
for job in image-digits image-python-digits; do
  stoke_c status "$job" --watch >"$work/watch-$job.txt" 2>/dev/null \
    || fail "the job $job: $(cat "$work/watch-$job.txt") $(tail -n 20 "$work/worker-3.log")"
  grep -q '^state: succeeded' "$work/watch-$job.txt" || fail "the job $job did not succeed: $(cat "$work/watch-$job.txt")"
  python scripts/wheel_check.py "$job_dir/state/jobs/$job/outputs" "$assets/digits" >&2 \
    || fail "the job $job's outputs"
  # Every worker ran part of it (the report's per-worker devices).
  stoke_c report "$job" --json >"$work/report-$job.json" || fail "stoke report $job (coordinator image)"
  for w in 1 2 3; do
    grep -q "image-w$w" "$work/report-$job.json" \
      || fail "worker image-w$w (${worker_image[$w]}) took no part in $job: $(cat "$work/report-$job.json") $(tail -n 20 "$work/worker-$w.log")"
  done
done
jobs_s=$(($(date +%s) - t0))
# Each worker image's Python, and the one stoke wheel in both.
for w in 1 3; do
  want=3.11
  [ "$w" = 3 ] && want=3.13
  got=$("${run[@]}" "${worker_ctr[$w]}" -- python3 -c 'import sys, stoke._native; print("%d.%d" % sys.version_info[:2], stoke._native.__file__)' 2>&1) \
    || fail "stoke._native in ${worker_image[$w]}: $got"
  case "$got" in
    "$want "*abi3.so) ;;
    *) fail "${worker_image[$w]}: want Python $want with the abi3 stoke._native, got: $got" ;;
  esac
done

sizes=$(buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E 'stoke-(coordinator|worker)|python' | sort)
log "images:"
echo "$sizes" | sed 's/^/  /' >&2
summary=$(echo "$sizes" | awk '{ sub(".*/", "", $1); printf "%s%s %s %s", sep, $1, $2, $3; sep = ", " }')
echo "image: ok ($(($(date +%s) - started))s; 2 jobs through 3 image workers (CPython 3.11 and 3.13) in ${jobs_s}s, 1797 records each exactly once; $summary)"
