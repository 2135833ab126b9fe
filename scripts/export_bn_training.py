#!/usr/bin/env python3
"""Writes tests/fixtures/bn_train/: a small CNN with BatchNormalization (conv, BN, ReLU
twice, a global average, a linear layer, cross-entropy against labels), exported by the
TorchScript exporter twice, and PyTorch's own training run of it for the test to follow.

    python3 scripts/export_bn_training.py tests/fixtures/bn_train

train.onnx     exported with training=TRAINING: BatchNormalization nodes with
               training_mode = 1, the running statistics as initializers
preserve.onnx  exported from eval mode with training=PRESERVE and no constant folding:
               inference BatchNormalization nodes (the exporter shares the two BNs'
               fresh statistics, equal ones and zeros, through Identity nodes)
x.npy, y.npy   [steps, batch, 3, 8, 8] float64 images and [steps, batch] labels
and for each export (NAME train or preserve, each from the state its file holds):
NAME.losses.npy     PyTorch's loss at each of the steps, in float64, in train() mode
                    (batch statistics), SGD lr 0.1 momentum 0.9
NAME.final.<p>.npy  every parameter and buffer after the steps (the BN running
                    statistics among them, moved as PyTorch moves them: towards the
                    unbiased batch variance, momentum 0.1)
NAME.biased.<bn>.running_var.npy  the running variance as ONNX's training_mode = 1
                    moves it (towards the biased batch variance)
NAME.eval_logits.npy  the trained model's logits in eval() mode on x[0] (for train,
                    with the biased running variance)
"""
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import onnx
import onnx.numpy_helper as nh

STEPS, BATCH = 5, 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x, labels):
        h = F.relu(self.b1(self.c1(x)))
        h = F.relu(self.b2(self.c2(h)))
        logits = self.fc(h.mean((2, 3)))
        return logits, F.cross_entropy(logits, labels)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    net = Net()
    # BN weights and biases away from their fresh ones and zeros, so that the exporter
    # does not share them with anything; the fresh running statistics it does share.
    with torch.no_grad():
        for bn in [net.b1, net.b2]:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_(0.0, 0.2)
    x = torch.randn(STEPS, BATCH, 3, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 4, (STEPS, BATCH))
    # Tracing in training mode runs BN forward, which moves the running statistics: each
    # export starts from the same state, and the reference from it too.
    start = {k: v.clone() for k, v in net.state_dict().items()}
    for name, mode, train in [
        ("train", torch.onnx.TrainingMode.TRAINING, True),
        ("preserve", torch.onnx.TrainingMode.PRESERVE, False),
    ]:
        net.train(train)
        torch.onnx.export(
            net,
            (x[0].float(), y[0]),
            os.path.join(out, f"{name}.onnx"),
            dynamo=False,
            training=mode,
            do_constant_folding=False,
            opset_version=17,
            input_names=["x", "labels"],
            output_names=["logits", "loss"],
        )
        net.load_state_dict(start)
    np.save(os.path.join(out, "x.npy"), x.numpy())
    np.save(os.path.join(out, "y.npy"), y.numpy())
    # The TorchScript exporter writes train.onnx's running statistics as tracing left
    # them (one forward in train mode moved them); preserve.onnx holds the fresh ones.
    inits = {
        t.name: torch.from_numpy(nh.to_array(t).copy())
        for t in onnx.load(os.path.join(out, "train.onnx")).graph.initializer
    }
    for name, state in [
        ("train", {k: inits.get(k, v) for k, v in start.items()}),
        ("preserve", start),
    ]:
        losses = reference(out, name, state, x, y)
    print("losses", losses)


def reference(out, name, state, x, y):
    """PyTorch's run, in float64 from the exported float32 values; files <name>.*.npy."""
    ref = Net().double()
    ref.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()})
    ref.train()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    # ONNX's training-mode running variance, kept beside PyTorch's from each BN's input.
    biased = {b: getattr(ref, b).running_var.clone() for b in ["b1", "b2"]}

    def keep(bn):
        def hook(mod, inp):
            v = inp[0].detach().var((0, 2, 3), unbiased=False)
            biased[bn] = 0.9 * biased[bn] + 0.1 * v

        return hook

    hooks = [getattr(ref, bn).register_forward_pre_hook(keep(bn)) for bn in biased]
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        _, loss = ref(x[s], y[s])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    for bn, v in biased.items():
        np.save(os.path.join(out, f"{name}.biased.{bn}.running_var.npy"), v.numpy())
    ref.eval()
    with torch.no_grad():
        # train.onnx's running variance is ONNX's: its eval logits are computed from it.
        final = {k: v.clone() for k, v in ref.state_dict().items()}
        if name == "train":
            for bn, v in biased.items():
                getattr(ref, bn).running_var.copy_(v)
        logits, _ = ref(x[0], y[0])
        ref.load_state_dict(final)
    np.save(os.path.join(out, f"{name}.losses.npy"), np.array(losses))
    np.save(os.path.join(out, f"{name}.eval_logits.npy"), logits.numpy())
    for k, v in ref.state_dict().items():
        if v.is_floating_point():
            np.save(os.path.join(out, f"{name}.final.{k}.npy"), v.numpy())
    return losses


if __name__ == "__main__":
    main()
