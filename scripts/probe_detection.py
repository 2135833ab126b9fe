#!/usr/bin/env python3
"""Detection exports against ONNX Runtime: torchvision's detection models (random weights,
TorchScript exporter) whose NonZero, TopK and NonMaxSuppression work on their own scores,
so graphrun runs them in stages. The classification heads' weights are redrawn wider
(N(0, 0.5)) so that the scores differ: with the default initialisation every class scores
about 1/91 and the order of tied boxes is arbitrary. Writes only under /tmp/probe_detection.

    cargo build --release
    python3 scripts/probe_detection.py [--backends cpu,wgpu] [--opset 17]
        [--models ssdlite320_mobilenet_v3_large,fasterrcnn_mobilenet_v3_large_320_fpn]

Prints, per model and backend, each output's shape and largest difference from ONNX
Runtime's. Needs torch, torchvision, onnxruntime and numpy.
"""
import argparse
import os
import subprocess
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torchvision

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
EXE = os.environ.get("GRAPHRUN", os.path.join(ROOT, "target", "release", "graphrun"))
OUT = "/tmp/probe_detection"
# Keep every box Faster R-CNN scores, so that its outputs are not empty.
EXTRA = {"fasterrcnn_mobilenet_v3_large_320_fpn": {"box_score_thresh": 0.0}}


def export(name, opset, path):
    torch.manual_seed(0)
    m = getattr(torchvision.models.detection, name)(
        weights=None, weights_backbone=None, **EXTRA.get(name, {})).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "classification_head" in n or "cls_logits" in n or "cls_score" in n:
                p.copy_(torch.randn_like(p) * 0.5)
    x = torch.rand(3, 320, 320)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, ([x],), path, dynamo=False, opset_version=opset, input_names=["x"])
    return x.numpy()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="ssdlite320_mobilenet_v3_large,"
                    "fasterrcnn_mobilenet_v3_large_320_fpn")
    ap.add_argument("--backends", default="cpu,wgpu")
    ap.add_argument("--opset", type=int, default=17)
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    for name in a.models.split(","):
        path = os.path.join(OUT, f"{name}_{a.opset}.onnx")
        x = export(name, a.opset, path)
        xf = os.path.join(OUT, "x.npy")
        np.save(xf, x)
        want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
        names = [o.name for o in onnx.load(path).graph.output]
        for be in a.backends.split(","):
            d = os.path.join(OUT, f"{name}_{be}")
            r = subprocess.run([EXE, "run", path, "--input", f"x={xf}", "--backend", be,
                                "--out-dir", d], capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{name} {be}: graphrun failed: {r.stderr.strip().splitlines()[-1]}")
                continue
            cells = []
            for n, w in zip(names, want):
                g = np.load(os.path.join(d, f"{n}.npy"))
                if g.shape != w.shape:
                    cells.append(f"{n} shape {g.shape} != {w.shape}")
                elif w.size:
                    diff = np.abs(g.astype(np.float64) - w.astype(np.float64)).max()
                    cells.append(f"{n} {w.shape} max diff {diff:.3g}")
                else:
                    cells.append(f"{n} {w.shape} (empty, as ORT's)")
            print(f"{name} {be}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
