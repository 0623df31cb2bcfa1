"""The seed test's data: sklearn's digits as Parquet (pixels first, then
label; ids in `id`) and a TorchScript classifier, in the folder given."""

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from sklearn.datasets import load_digits

out = Path(sys.argv[1])
(out / "digits").mkdir(parents=True, exist_ok=True)
digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
ids = [f"d{i:04d}" for i in range(len(x))]
for part, lo in enumerate(range(0, len(x), 600)):
    hi = min(lo + 600, len(x))
    pq.write_table(pa.table({
        "pixels": pa.FixedSizeListArray.from_arrays(pa.array(x[lo:hi].reshape(-1)), 64),
        "label": pa.array(digits.target[lo:hi].astype(np.int64)),
        "id": pa.array(ids[lo:hi], pa.string()),
    }), out / "digits" / f"part-{part}.parquet", row_group_size=200)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).eval()
torch.jit.script(model).save(str(out / "digits_model.pt"))
