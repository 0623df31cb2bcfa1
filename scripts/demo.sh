#!/usr/bin/env bash
# The README's first command: a real job on the embedded default (file
# storage, a local coordinator and 2 worker processes on this machine).
#
# Classifies the 1,797 handwritten digits that ship inside scikit-learn with a
# small model trained here and exported as a .pt2 package (torch.export +
# AOTInductor; a TorchScript copy is kept too), then checks the
# committed outputs against the labels and prints the accuracy.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$STOKE_REPO"

echo "stoke demo: building (first time: several minutes)" >&2
cargo build -q -p stoke-cli -p stoke -p stoke-worker

assets="$STOKE_CACHE/demo"
python scripts/demo_assets.py "$assets"

run_dir="${STOKE_DEMO_DIR:-$STOKE_CACHE/demo-run}"
rm -rf "$run_dir"
mkdir -p "$run_dir"
"$STOKE_BIN_DIR/stoke" run --local 2 --device cpu --root "$run_dir/state" "$assets/digits.toml" | tee "$run_dir/summary.txt"

manifest=$(sed -n 's/^manifest: //p' "$run_dir/summary.txt")
python scripts/demo_report.py "$manifest" "$assets/digits" "$assets/test_ids.txt"
