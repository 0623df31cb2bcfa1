"""GPU check of stoke's model runner: a seeded MLP as TorchScript and as a
.pt2 package compiled for CUDA, a Parquet dataset, and the reference outputs
from torch itself on the GPU."""
import json, sys
from pathlib import Path
import numpy as np, pyarrow as pa, pyarrow.parquet as pq, torch
from torch.export import Dim

out = Path(sys.argv[1]); (out / "data").mkdir(parents=True, exist_ok=True)
torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).eval()
n = 3000
x = np.random.default_rng(7).standard_normal((n, 256)).astype(np.float32)
ids = [f"r{i:05d}" for i in range(n)]
feat = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 256)
pq.write_table(pa.table({"id": ids, "features": feat}), out / "data/part-0.parquet", row_group_size=500)
torch.jit.script(model).save(str(out / "model.pt"))
cuda = model.to("cuda")
ex = torch.randn(64, 256, device="cuda")
prog = torch.export.export(cuda, (ex,), dynamic_shapes=({0: Dim("batch", min=1, max=1024)},))
torch._inductor.aoti_compile_and_package(prog, package_path=str(out / "model.pt2"),
    inductor_configs={"aot_inductor.metadata": {"torch_version": torch.__version__}})
# The reference: the eager model on the GPU (aoti_load_package segfaulted in
# python on this machine's sandbox).
with torch.inference_mode():
    ref = cuda(torch.from_numpy(x).cuda()).float().cpu().numpy()
json.dump({"argmax": ref.argmax(1).tolist(), "scores": ref.tolist(), "ids": ids}, open(out / "ref.json", "w"))
print("exported; torch", torch.__version__, "cuda", torch.cuda.get_device_name(0))
