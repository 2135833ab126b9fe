#!/usr/bin/env python3
"""Writes a small image-classification data set for `graphrun train`: colored shapes on
noisy backgrounds, four classes (0 disc, 1 square, 2 triangle, 3 cross), each shape at a
random place, size and color. Seeded: the same arguments give the same files.

    python3 scripts/make_shapes.py OUT_DIR [--train 2048] [--val 512] [--size 32] [--seed 0]

OUT_DIR/train_x.npy  float32 [train, 3, size, size], roughly zero mean and unit variance
OUT_DIR/train_y.npy  int64 [train], the class of each image
OUT_DIR/val_x.npy, OUT_DIR/val_y.npy  the held-out images, drawn after the training ones

Only numpy is needed.
"""
import argparse
import os

import numpy as np

CLASSES = ["disc", "square", "triangle", "cross"]


def draw(rng, size):
    """One image [3, size, size] and its class."""
    label = int(rng.integers(len(CLASSES)))
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    r = rng.uniform(0.18, 0.32) * size
    cy, cx = rng.uniform(r, size - r, 2)
    dy, dx = (yy - cy) / r, (xx - cx) / r
    if label == 0:
        mask = dy * dy + dx * dx <= 1.0
    elif label == 1:
        mask = (np.abs(dy) <= 0.8) & (np.abs(dx) <= 0.8)
    elif label == 2:
        # Apex up: inside when below the apex and within the widening sides.
        mask = (dy <= 0.8) & (np.abs(dx) <= (dy + 1.0) * 0.55)
    else:
        mask = ((np.abs(dy) <= 0.9) & (np.abs(dx) <= 0.28)) | (
            (np.abs(dx) <= 0.9) & (np.abs(dy) <= 0.28)
        )
    bg = rng.uniform(0.0, 1.0, 3)
    fg = rng.uniform(0.0, 1.0, 3)
    # Keep the shape visible: at least 0.35 apart in some channel.
    while np.abs(fg - bg).max() < 0.35:
        fg = rng.uniform(0.0, 1.0, 3)
    img = np.where(mask[None], fg[:, None, None], bg[:, None, None])
    img = img + rng.normal(0.0, 0.08, img.shape)
    return img.astype(np.float32), label


def make(rng, n, size):
    xs = np.empty((n, 3, size, size), np.float32)
    ys = np.empty(n, np.int64)
    for i in range(n):
        xs[i], ys[i] = draw(rng, size)
    return (xs - 0.5) / 0.3, ys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=2048)
    ap.add_argument("--val", type=int, default=512)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    os.makedirs(a.out, exist_ok=True)
    for split, n in [("train", a.train), ("val", a.val)]:
        x, y = make(rng, n, a.size)
        np.save(os.path.join(a.out, f"{split}_x.npy"), x)
        np.save(os.path.join(a.out, f"{split}_y.npy"), y)
        counts = np.bincount(y, minlength=len(CLASSES))
        print(f"{split}: {n} images {a.size}x{a.size}, per class {counts.tolist()}")


if __name__ == "__main__":
    main()
