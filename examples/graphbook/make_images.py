"""Writes a folder of PNG files for the example: ``python make_images.py
FOLDER [COUNT] [SIZE]`` (default 2000 images of 96x96 RGB). Image ``i``
is the same on every run."""

import pathlib
import sys

import numpy as np
from PIL import Image


def write(folder, count=2000, size=96):
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        rng = np.random.default_rng(i)
        pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img-{i:06d}.png")


if __name__ == "__main__":
    args = sys.argv[1:]
    write(args[0], *(int(a) for a in args[1:]))
