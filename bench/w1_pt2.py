"""Exports W1's model as a .pt2 package (torch.export + AOTInductor), next to
the TorchScript copy bench/w1_data.py writes: the same weights (the same
seed and module), a dynamic batch up to 1024 (W1's batch size).

    python bench/w1_pt2.py OUT_DIR

writes OUT_DIR/model.pt2 (about a minute on 2 cores). Runs again only when
OUT_DIR/model-pt2.json is missing or describes other parameters.
"""

import json
import os
import sys

import torch
from torch.export import Dim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import w1_data  # noqa: E402

BATCH = 1024


def main():
    out = os.path.abspath(sys.argv[1])
    marker = os.path.join(out, "model-pt2.json")
    want = {"w1": w1_data.describe(), "batch": BATCH, "torch": torch.__version__}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == want:
                print(f"w1: model.pt2 already exported in {out}", file=sys.stderr)
                return
    torch.manual_seed(w1_data.SEED)
    model = w1_data.MLP().eval()
    # The TorchScript copy holds the same weights: check before exporting.
    scripted = torch.jit.load(os.path.join(out, "model.pt"))
    x = torch.randn(BATCH, w1_data.DIM)
    with torch.no_grad():
        assert torch.equal(scripted(x), model(x)), "model.pt holds other weights"
    program = torch.export.export(
        model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=BATCH)},)
    )
    tmp = os.path.join(out, f".model-{os.getpid()}.pt2")
    torch._inductor.aoti_compile_and_package(
        program,
        package_path=tmp,
        inductor_configs={"aot_inductor.metadata": {"torch_version": torch.__version__}},
    )
    os.replace(tmp, os.path.join(out, "model.pt2"))
    with open(marker + ".tmp", "w") as f:
        json.dump(want, f, indent=1)
    os.replace(marker + ".tmp", marker)
    print(f"w1: exported model.pt2 to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
