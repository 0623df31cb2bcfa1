#!/usr/bin/env bash
# The README's second command: every check CI runs. Installs what it needs
# (the Python venv with torch, cached in ~/.cache/stoke), then formatting,
# lints, the coordinator's libtorch-free build, the deploy manifests, the
# book and its links, and the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

echo "== commit subjects after 2640d4d: at most 72 characters"
# Earlier subjects stay as they landed (history is never rewritten); from
# the commit that added .githooks/commit-msg on, every subject fits. A
# clone without that history (a shallow one) has nothing here to check.
habits_since=2640d4d
if git cat-file -e "$habits_since^{commit}" 2>/dev/null; then
  long="$(git log --no-merges --format='%h%x09%s' "$habits_since..HEAD" | awk -F'\t' 'length($2) > 72')"
  if [ -n "$long" ]; then
    echo "commit subjects longer than 72 characters:" >&2
    echo "$long" >&2
    exit 1
  fi
fi

echo "== the coordinator's state machine decides without I/O"
# The machine (machine/, ADR 005 and 023) built alone: stoke-core without
# its `io` feature, no tokio, object_store or tonic in its dependencies,
# and machine/clippy.toml refusing clocks, threads, processes, the
# environment, files and channels. The library alone: its tests' dev
# dependencies would turn `io` back on.
cargo clippy -q -p stoke-machine --lib -- -D warnings

echo "== cargo fmt --check"
cargo fmt --all --check

echo "== cargo clippy"
cargo clippy --workspace --all-targets -q -- -D warnings

echo "== the coordinator, the stoke CLI and the data crate do not link libtorch (nor Python)"
for pkg in stoke-coordinator stoke-cli stoke-data; do
  if cargo tree -p "$pkg" -e normal,build --prefix none | grep -Eq '^(tch|torch-sys|pyo3|pyo3-ffi) '; then
    echo "$pkg depends on tch/torch-sys/pyo3" >&2
    exit 1
  fi
done

# deploy/: yamllint, Dockerfile rules, every kustomization rendered and
# validated against the Kubernetes schemas (tools cached in ~/.cache/stoke).
"$STOKE_REPO/scripts/check-deploy.sh"

echo "== book"
# The book (docs/, mdBook) builds and none of its links is broken, nor any
# from the READMEs into it (tools cached in ~/.cache/stoke/tools). The job
# specs it prints are checked by core/tests/doc_specs.rs, under cargo test.
"$STOKE_REPO/scripts/book.sh"

echo "== cargo test"
# The S3-protocol server the integration tests start (cached in ~/.cache/stoke).
"$STOKE_REPO/scripts/s3-server.sh" >/dev/null
# The Azure Blob emulator (Azurite, from npm) the Azure tests start.
"$STOKE_REPO/scripts/azurite.sh" >/dev/null
# The Iceberg REST catalog server (lakana-server, from PyPI) the Iceberg
# REST tests start.
"$STOKE_REPO/scripts/lakana.sh" >/dev/null
# The headless browser the status-page test renders the page in.
"$STOKE_REPO/scripts/browser.sh" >/dev/null
# The stoke Python package (maturin), installed into the venv; rebuilt only
# when its sources change (cached in ~/.cache/stoke/wheels).
"$STOKE_REPO/scripts/python-package.sh"
# The LLM lane's engine venv (vLLM, its own torch pins kept out of the
# stoke venv) and its tiny random-weight model (cached in ~/.cache/stoke):
# tests/tests/llm.rs runs real vLLM engines with them.
STOKE_LLM_PYTHON="$("$STOKE_REPO/scripts/llm-venv.sh")"
export STOKE_LLM_PYTHON
"$STOKE_LLM_PYTHON" "$STOKE_REPO/scripts/llm_fixture.py" "$STOKE_CACHE/llm-fixture" >/dev/null
cargo build -q --workspace --bins
cargo test --workspace --no-fail-fast 2>&1 | tee "$STOKE_CACHE/last-test.log"
