# syntax=docker/dockerfile:1.7
# The coordinator image: the stoke-client wheel (stoke-coordinator and the
# stoke CLI, built in it; no torch, no libtorch, no Rust toolchain) on a
# Python base image, as a non-root user. The build context is a folder
# holding the stoke-client release wheel:
#
#   scripts/python-package.sh --release --no-install --client-wheel   # prints its path
#   docker build -f deploy/images/coordinator.Dockerfile -t stoke-coordinator:0.1.0 WHEEL_FOLDER
#
# scripts/image.sh builds and runs it here. PYTHON_IMAGE: any CPython 3.11 or
# later (stoke-client is an abi3 wheel); PIP_ARGS: pip options for the
# install.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS install
ARG PIP_ARGS=""
COPY stoke_client-*.whl /wheels/
RUN python3 -m venv /opt/stoke/venv \
 && /opt/stoke/venv/bin/pip install --no-cache-dir --disable-pip-version-check $PIP_ARGS /wheels/stoke_client-*.whl \
 && ! /opt/stoke/venv/bin/python -c "import torch" 2>/dev/null

FROM ${PYTHON_IMAGE} AS runtime
COPY --from=install /opt/stoke/venv /opt/stoke/venv
ENV PATH="/opt/stoke/venv/bin:${PATH}" \
    HOME=/tmp
RUN stoke-coordinator --version
# The uid of distroless's "nonroot", which the manifests' runAsUser names.
USER 65532:65532
WORKDIR /tmp
# gRPC (workers, clients) and HTTP (/healthz, /readyz, /metrics).
EXPOSE 7070 8080
ENTRYPOINT ["/opt/stoke/venv/bin/stoke-coordinator"]
