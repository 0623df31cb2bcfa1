# syntax=docker/dockerfile:1.7
# The worker image: the stoke wheel (stoke-worker, the stoke CLI and the
# stoke Python package; nothing to compile, so no Rust toolchain) with torch
# 2.11.0 and its CUDA runtime libraries from PyPI (CUDA 13: GPU nodes need
# an NVIDIA driver >= 580), on a Python base image, as a non-root user. The
# build context is a folder holding the two release wheels, stoke and
# stoke-client:
#
#   scripts/python-package.sh --release --no-install --wheel   # prints the stoke wheel; stoke-client's is beside it
#   docker build -f deploy/images/worker.Dockerfile -t stoke-worker:0.1.0 WHEEL_FOLDER
#
# scripts/image.sh builds and runs it here (buildah, debootstrap stand-ins
# for the base images), on CPython 3.11 and 3.13. PYTHON_IMAGE may be any
# CPython 3.11 or later image (both wheels are abi3); no shared libpython
# is needed: the worker runs in the image's Python (ADR 022). PIP_ARGS
# passes pip options to the install (scripts/image.sh installs from a local
# wheelhouse with "--no-index --find-links /wheelhouse").
#
# Where libraries are found at run time: stoke-worker is the venv's Python
# running the worker (stoke/_worker.py) through the compiled stoke._native,
# whose rpath $ORIGIN/../torch/lib is the torch wheel's libtorch beside it;
# libtorch_cuda.so finds cuDNN, cuBLAS, NCCL and the CUDA runtime through
# its own rpath, $ORIGIN/../../nvidia/*/lib. Python processors
# (`[processor] python = "module:Class"`) run in that same Python, with the
# venv's torch, numpy, pyarrow and the stoke package. Add your code as a
# layer (COPY to /opt/stoke/code, pip install your dependencies into
# /opt/stoke/venv) or mount it; see the book,
# docs/src/guide/processors/python.md ("Kubernetes"). LLM workers: add the
# engine's venv (vLLM with its own torch) as a layer and point `[llm]
# python` or STOKE_LLM_PYTHON at it; see docs/src/guide/llm.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS install
ARG PIP_ARGS=""
COPY stoke_client-*.whl stoke-*.whl /wheels/
RUN python3 -m venv /opt/stoke/venv \
 && /opt/stoke/venv/bin/pip install --no-cache-dir --disable-pip-version-check $PIP_ARGS \
      /wheels/stoke_client-*.whl "$(ls /wheels/stoke-[0-9]*.whl)" \
 && /opt/stoke/venv/bin/pip check

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 10001 stoke \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin stoke
COPY --from=install /opt/stoke/venv /opt/stoke/venv
ENV PATH="/opt/stoke/venv/bin:${PATH}" \
    OMP_WAIT_POLICY=PASSIVE \
    GOMP_SPINCOUNT=10000 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    HOME=/tmp
# Every library resolves, libtorch_cuda.so's too, which the worker loads when
# a device needs it (the driver's libcuda.so comes from the host at run
# time, through the NVIDIA container runtime, and is loaded lazily); the
# commands start; torch is the worker's.
RUN site="$(/opt/stoke/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
 && ! ldd "$site/torch/lib/libtorch_cuda.so" | grep 'not found' \
 && stoke-worker --version && stoke --version \
 && /opt/stoke/venv/bin/python -c "import stoke, torch; assert torch.__version__.startswith('2.11.0'); stoke.TorchBatchProcessor"
# OMP_WAIT_POLICY / GOMP_SPINCOUNT: how libtorch's OpenMP threads wait
# (stoke_core::OPENMP_WAIT: spin about 0.1 ms, then sleep; stoke-worker sets
# them itself when they are unset, this only says so). The GPUs themselves are
# chosen by the device plugin (NVIDIA_VISIBLE_DEVICES), not here.
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["/opt/stoke/venv/bin/stoke-worker"]
