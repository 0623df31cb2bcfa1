# syntax=docker/dockerfile:1.7
# The coordinator image: stoke-coordinator alone, no libtorch, on a
# distroless runtime (glibc, CA certificates, nothing else), as a non-root
# user. Build from the repository root:
#
#   docker build -f deploy/images/coordinator.Dockerfile -t stoke-coordinator:dev .
#
# Layers: the toolchain with cargo-chef; a recipe of the workspace's
# dependencies (changes only when a Cargo.toml or Cargo.lock does); the
# dependencies compiled from the recipe (the slow part, cached until the
# recipe changes); then stoke's own crates.

ARG RUST_VERSION=1.95
ARG DEBIAN=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN} AS chef
RUN cargo install --locked cargo-chef@0.1.78
WORKDIR /src

FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS builder
COPY --from=planner /src/recipe.json recipe.json
# protoc comes from the protoc-bin-vendored crate: nothing to install.
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    cargo chef cook --release --locked --recipe-path recipe.json -p stoke-coordinator
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    cargo build --release --locked -p stoke-coordinator --bin stoke-coordinator \
 && if cargo tree -p stoke-coordinator -e normal,build --prefix none | grep -Eq '^(tch|torch-sys) '; then \
      echo "stoke-coordinator depends on tch/torch-sys" >&2; exit 1; \
    fi \
 && cp target/release/stoke-coordinator /stoke-coordinator

# glibc 2.36 like the builder (both Debian 12), libgcc, CA certificates.
FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=builder /stoke-coordinator /usr/local/bin/stoke-coordinator
# distroless's "nonroot" user, by number so Kubernetes' runAsNonRoot can
# verify it.
USER 65532:65532
# gRPC (workers, clients) and HTTP (/healthz, /readyz, /metrics).
EXPOSE 7070 8080
ENTRYPOINT ["/usr/local/bin/stoke-coordinator"]
