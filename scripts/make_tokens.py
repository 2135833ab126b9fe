#!/usr/bin/env python3
"""Writes a token data set for fine-tuning a language model with `graphrun train`: each
sequence counts through the vocabulary from a random start by a random step (1 to 3),
so that the next token follows from the two before it. Seeded: the same arguments give
the same files. Only numpy is needed.

    python3 scripts/make_tokens.py OUT_DIR [--vocab 100] [--seq 16] [--train 512] [--val 128] [--seed 0]

OUT_DIR/train_ids.npy     int64 [train, seq], the model's input_ids
OUT_DIR/train_labels.npy  int64 [train, seq], the next token at each position (-100, the
                          ignored label, at the last)
OUT_DIR/val_ids.npy, OUT_DIR/val_labels.npy  the held-out sequences

Train a model exported with its logits as output on it with
    graphrun train model.onnx --cross-entropy logits \\
        --data input_ids=OUT_DIR/train_ids.npy --data labels=OUT_DIR/train_labels.npy
"""
import argparse
import os

import numpy as np


def make(rng, n, seq, vocab):
    start = rng.integers(0, vocab, (n, 1))
    step = rng.integers(1, 4, (n, 1))
    full = (start + step * np.arange(seq + 1)[None, :]) % vocab
    ids = full[:, :seq].astype(np.int64)
    labels = full[:, 1:].astype(np.int64)
    labels[:, -1] = -100
    return ids, labels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--train", type=int, default=512)
    ap.add_argument("--val", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    os.makedirs(a.out, exist_ok=True)
    for split, n in [("train", a.train), ("val", a.val)]:
        ids, labels = make(rng, n, a.seq, a.vocab)
        np.save(os.path.join(a.out, f"{split}_ids.npy"), ids)
        np.save(os.path.join(a.out, f"{split}_labels.npy"), labels)
        print(f"{split}: {n} sequences of {a.seq} tokens, vocabulary {a.vocab}")


if __name__ == "__main__":
    main()
