#!/usr/bin/env python3
"""Padding waste of the ragged workload under a batching rule: the share of
padded tensor elements that are padding. Replays stoke's cut rule
(data/src/batcher.rs `budget_cut`) over the stored lengths, shard by
shard (one shard per file here).

Usage: ragged_waste.py LENGTHS_NPY FILES BATCH_SIZE [MAX_ELEMENTS]
"""

import sys

import numpy as np


def budget_cut(lengths, batch_size, max_elements):
    longest = 0
    for n, length in enumerate(lengths):
        if n == batch_size:
            return n
        candidate = max(longest, length)
        if n > 0 and (n + 1) * candidate > max_elements:
            return n
        longest = candidate
    return len(lengths)


def main() -> None:
    lengths = np.load(sys.argv[1])
    files = int(sys.argv[2])
    batch_size = int(sys.argv[3])
    max_elements = int(sys.argv[4]) if len(sys.argv) > 4 else None
    real = padded = batches = 0
    for shard in np.array_split(lengths, files):
        i = 0
        while i < len(shard):
            if max_elements is None:
                k = min(batch_size, len(shard) - i)
            else:
                k = budget_cut(shard[i:], batch_size, max_elements)
            batch = shard[i:i + k]
            real += int(batch.sum())
            padded += int(batch.max()) * len(batch)
            batches += 1
            i += k
    print(f"batches={batches} real={real} padded={padded} waste={1 - real / padded:.3f}")


if __name__ == "__main__":
    main()
