#!/usr/bin/env python3
"""The ragged workload: variable-length sequences, and a model whose cost
grows with the padded length.

Usage: ragged_data.py OUT_DIR

Writes (idempotently) OUT_DIR/data/part-N.parquet: 60,000 records in 4 files,
columns `id` (string) and `tokens` (list<float32>, lengths 4..512 from a
skewed log-normal: most short, a few long), and OUT_DIR/model.pt: a
TorchScript module forward(x [B, L] float, lengths [B] int64) -> [B, 10] that
lifts every position to 64 features, masks the padding out, and mean-pools —
so padded positions cost as much as real ones, as in real sequence models.
OUT_DIR/lengths.npy keeps the lengths for the padding-waste report.
"""

import os
import sys
from pathlib import Path

RECORDS = 60_000
FILES = 4
VERSION = "1"


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    marker = out / ".ragged"
    if marker.exists() and marker.read_text() == VERSION:
        return
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(mean=3.6, sigma=0.8, size=RECORDS), 4, 512).astype(np.int64)
    (out / "data").mkdir(parents=True, exist_ok=True)
    per_file = RECORDS // FILES
    for f in range(FILES):
        lo, hi = f * per_file, (f + 1) * per_file
        ids = [f"q{i:06d}" for i in range(lo, hi)]
        tokens = [rng.standard_normal(int(n)).astype(np.float32) for n in lengths[lo:hi]]
        table = pa.table({
            "id": pa.array(ids, pa.string()),
            "tokens": pa.array(tokens, pa.list_(pa.float32())),
        })
        tmp = out / "data" / f".part-{f}.tmp"
        pq.write_table(table, tmp, row_group_size=5000)
        os.replace(tmp, out / "data" / f"part-{f}.parquet")
    np.save(out / "lengths.npy", lengths)

    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lift = torch.nn.Linear(1, 64)
            self.mix = torch.nn.Linear(64, 64)
            self.head = torch.nn.Linear(64, 10)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.mix(torch.relu(self.lift(x.unsqueeze(-1)))))
            positions = torch.arange(x.size(1), device=x.device).unsqueeze(0)
            mask = (positions < lengths.unsqueeze(1)).to(h.dtype).unsqueeze(-1)
            pooled = (h * mask).sum(1) / lengths.clamp(min=1).to(h.dtype).unsqueeze(-1)
            return self.head(pooled)

    torch.manual_seed(3)
    torch.jit.script(Pool().eval()).save(str(out / "model.pt"))
    marker.write_text(VERSION)


if __name__ == "__main__":
    main()
