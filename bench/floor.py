"""Contender (a), the model-only floor: the W1 TorchScript forward over
in-memory tensors, batch 1024, no I/O. Times only the forward passes (after a
warm-up), so interpreter start-up and imports are not counted.

    python bench/floor.py W1_DIR [--threads 2]

Prints one line: `result records=N seconds=S records_per_s=R`.
"""

import argparse
import os
import time

import torch

RECORDS = 200_000
DIM = 256
BATCH = 1024


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("w1_dir")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = torch.jit.load(os.path.join(args.w1_dir, "model.pt"))
    model.eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(RECORDS, DIM, generator=gen, dtype=torch.float32)
    batches = [x[i : i + BATCH] for i in range(0, RECORDS, BATCH)]
    with torch.no_grad():
        for b in batches[:20]:
            model(b)
        started = time.perf_counter()
        for b in batches:
            model(b)
        seconds = time.perf_counter() - started
    print(f"result records={RECORDS} seconds={seconds:.4f} records_per_s={RECORDS / seconds:.0f}")


if __name__ == "__main__":
    main()
