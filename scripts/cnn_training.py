#!/usr/bin/env python3
"""A torchvision CNN trained by `graphrun train` on the shapes data set
(scripts/make_shapes.py), and the same training in PyTorch for comparison.

    python3 scripts/cnn_training.py export OUT_DIR [--arch resnet18]
        writes OUT_DIR/<arch>.onnx: torchvision's <arch> (random weights, 4 classes)
        with a cross-entropy loss against a `labels` input, exported by the TorchScript
        exporter in training mode (BatchNormalization keeps its batch statistics and
        running statistics; in eval mode the exporter folds it into the convolutions)
    python3 scripts/cnn_training.py torch DATA_DIR [--arch resnet18] [--epochs 3]
        [--batch 32] [--lr 0.001] [--threads 2] [--device cpu]
        trains the same architecture from the same kind of random start in PyTorch (Adam,
        train() mode) and prints the held-out loss and accuracy after each epoch and the
        time taken, as `graphrun train` does

Then, with DATA_DIR from make_shapes.py:
    graphrun train OUT_DIR/resnet18.onnx --loss loss --epochs 3 --batch-size 32 \\
        --data x=DATA_DIR/train_x.npy --data labels=DATA_DIR/train_y.npy \\
        --val-data x=DATA_DIR/val_x.npy --val-data labels=DATA_DIR/val_y.npy
"""
import argparse
import os
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision


class WithLoss(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, labels):
        logits = self.net(x)
        return logits, F.cross_entropy(logits, labels)


def model(arch):
    torch.manual_seed(0)
    return WithLoss(getattr(torchvision.models, arch)(num_classes=4))


def export(a):
    warnings.filterwarnings("ignore")
    os.makedirs(a.out, exist_ok=True)
    m = model(a.arch).train()
    x = torch.randn(2, 3, a.size, a.size)
    y = torch.zeros(2, dtype=torch.int64)
    path = os.path.join(a.out, f"{a.arch}.onnx")
    torch.onnx.export(
        m,
        (x, y),
        path,
        dynamo=False,
        training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False,
        opset_version=17,
        input_names=["x", "labels"],
        output_names=["logits", "loss"],
        dynamic_axes={"x": {0: "batch"}, "labels": {0: "batch"}, "logits": {0: "batch"}},
    )
    print(f"wrote {path}")


def train(a):
    torch.set_num_threads(a.threads)
    load = lambda s: torch.from_numpy(np.load(os.path.join(a.data, s)))
    xs, ys, vx, vy = (load(f) for f in ["train_x.npy", "train_y.npy", "val_x.npy", "val_y.npy"])
    xs, ys, vx, vy = (t.to(a.device) for t in (xs, ys, vx, vy))
    m = model(a.arch).to(a.device)
    opt = torch.optim.Adam(m.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for epoch in range(1, a.epochs + 1):
        m.train()
        order = torch.randperm(len(xs), generator=g).to(a.device)
        losses = []
        for k in range(len(xs) // a.batch):
            idx = order[k * a.batch : (k + 1) * a.batch]
            opt.zero_grad()
            _, loss = m(xs[idx], ys[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if a.device != "cpu":
            torch.cuda.synchronize()
        m.eval()
        with torch.no_grad():
            right, vl, nb = 0, 0.0, 0
            for k in range(0, len(vx), a.batch):
                logits, loss = m(vx[k : k + a.batch], vy[k : k + a.batch])
                right += (logits.argmax(1) == vy[k : k + a.batch]).sum().item()
                vl += loss.item()
                nb += 1
        print(
            f"epoch {epoch}: loss {np.mean(losses):.4f}, held-out loss {vl / nb:.4f}, "
            f"accuracy {100 * right / len(vx):.2f}% ({time.perf_counter() - t0:.1f} s in all)"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("out")
    e.add_argument("--arch", default="resnet18")
    e.add_argument("--size", type=int, default=32)
    t = sub.add_parser("torch")
    t.add_argument("data")
    t.add_argument("--arch", default="resnet18")
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--lr", type=float, default=0.001)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--device", default="cpu")
    a = ap.parse_args()
    export(a) if a.cmd == "export" else train(a)


if __name__ == "__main__":
    main()
