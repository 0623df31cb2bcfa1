# syntax=docker/dockerfile:1.7
# The worker image: stoke-worker and the stoke CLI, with libtorch and the
# CUDA runtime libraries from the torch 2.11.0 wheel (the same libtorch the
# tests use; CUDA 13, so GPU nodes need an NVIDIA driver >= 580), as a
# non-root user. Build from the repository root:
#
#   docker build -f deploy/images/worker.Dockerfile -t stoke-worker:dev .
#
# Layers, slowest-changing first: the toolchain; the Python venv with torch
# (several GB, changes only with the torch version); a recipe of the
# workspace's dependencies (cargo-chef); the dependencies compiled from it;
# stoke's own crates.
#
# Where libtorch is found at run time: the build links the binaries with an
# rpath to the venv's site-packages/torch/lib (worker/build.rs, from
# DEP_TCH_LIBTORCH_LIB), and libtorch_cuda.so finds cuDNN, cuBLAS, NCCL and
# the CUDA runtime through its own rpath, $ORIGIN/../../nvidia/*/lib. So the
# runtime stage keeps torch/lib and nvidia/ at exactly the builder's path
# (/opt/stoke/venv/lib/python3.11/site-packages) and sets no
# LD_LIBRARY_PATH: both rpaths hold as built, nothing else on the system can
# shadow those libraries, and no variable leaks into other processes. (An
# LD_LIBRARY_PATH would have to list torch/lib and every nvidia/*/lib.)
# The venv itself is kept whole: Python processors (`[processor] python =
# "module:Class"`, docs/src/adr/004) run in the worker's embedded CPython with
# this venv's torch, numpy, pyarrow and the stoke package. Add your code as a
# layer (COPY to /opt/stoke/code, pip install your dependencies into
# /opt/stoke/venv) or mount it there; see the book,
# docs/src/guide/processors/python.md ("Kubernetes").

ARG RUST_VERSION=1.95
ARG DEBIAN=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN} AS toolchain
# Debian 12's python3 is 3.11, as the venv path below says.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv libpython3.11-dev \
 && rm -rf /var/lib/apt/lists/*
ENV STOKE_VENV=/opt/stoke/venv
RUN python3 -m venv "$STOKE_VENV" \
 && "$STOKE_VENV/bin/pip" install --no-cache-dir --disable-pip-version-check torch==2.11.0 numpy pyarrow maturin==1.16.0 \
 && test -d "$STOKE_VENV/lib/python3.11/site-packages/torch/lib"
# tch's build takes libtorch from this Python's torch.
ENV PATH="/opt/stoke/venv/bin:${PATH}" \
    LIBTORCH_USE_PYTORCH=1
RUN cargo install --locked cargo-chef@0.1.78
WORKDIR /src

FROM toolchain AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM toolchain AS builder
COPY --from=planner /src/recipe.json recipe.json
# libtorch_cuda.so is not linked into stoke-worker or stoke-embedded: they
# load it at run time, from the folder libtorch_cpu.so came from, when a device needs
# CUDA and the host has the driver (worker/src/cuda.rs). So it must be in
# torch/lib, with every library it needs resolving (checked below and in the
# runtime stage). --target keeps build scripts and proc macros apart from
# the target's flags, as cargo-chef's recipe was cooked.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    cargo chef cook --release --locked --recipe-path recipe.json \
      --target "$(rustc -vV | sed -n 's/^host: //p')" -p stoke-worker -p stoke -p stoke-cli
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    host="$(rustc -vV | sed -n 's/^host: //p')" \
 && cargo build --release --locked --target "$host" -p stoke-worker -p stoke -p stoke-cli --bins \
 && mkdir -p /out \
 && cp "target/$host/release/stoke-worker" "target/$host/release/stoke" "target/$host/release/stoke-embedded" /out/ \
 && test -f "$STOKE_VENV/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so" \
 && readelf -d /out/stoke-worker | grep -q "R.*PATH.*$STOKE_VENV/lib/python3.11/site-packages/torch/lib" \
 && maturin build --release --locked -m python/Cargo.toml --interpreter "$STOKE_VENV/bin/python" \
      --compatibility manylinux_2_34 --auditwheel skip --out /out/wheels \
 && "$STOKE_VENV/bin/pip" install --no-cache-dir --no-deps /out/wheels/stoke-*.whl \
 && "$STOKE_VENV/bin/pip" uninstall -y maturin

FROM debian:${DEBIAN}-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates python3.11 libpython3.11 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 stoke \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin stoke
COPY --from=builder /opt/stoke/venv /opt/stoke/venv
COPY --from=builder /out/stoke-worker /out/stoke /out/stoke-embedded /usr/local/bin/
# Every library resolves, libtorch_cuda.so's too, which the worker loads when
# a device needs it (the driver's libcuda.so comes from the host at run
# time, through the NVIDIA container runtime, and is loaded lazily).
RUN ! ldd /usr/local/bin/stoke-worker | grep 'not found' \
 && ! ldd /opt/stoke/venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so | grep 'not found' \
 && ! ldd /usr/local/bin/stoke | grep 'not found' \
 && /opt/stoke/venv/bin/python -c "import stoke, torch; assert torch.__version__.startswith('2.11.0')"
# How libtorch's OpenMP threads wait (stoke_core::OPENMP_WAIT: spin about
# 0.1 ms, then sleep; the binaries would otherwise re-run themselves once
# to set this); the NVIDIA runtime mounts the
# driver's compute libraries. The GPUs themselves are chosen by the device
# plugin (NVIDIA_VISIBLE_DEVICES), not here.
ENV OMP_WAIT_POLICY=PASSIVE \
    GOMP_SPINCOUNT=10000 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HOME=/tmp
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["/usr/local/bin/stoke-worker"]
