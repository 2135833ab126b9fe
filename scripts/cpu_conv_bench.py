#!/usr/bin/env python3
"""CPU timings of convolutional networks: graphrun against ONNX Runtime on the same machine in
the same run. Exports torchvision's ResNet-50 and MobileNetV2 (random weights, TorchScript
exporter, opset 17, dynamic batch) to DIR, then for each batch size times ONNX Runtime
(CPUExecutionProvider, graph optimization level all, THREADS intra-op threads) and
`graphrun bench --backend cpu` (f32, fused) and prints the medians and their ratio.

    cargo build --release
    python3 scripts/cpu_conv_bench.py [--graphrun target/release/graphrun[,OTHER,...]]
        [--tunes KEY=VALUE[,KEY=VALUE...]] [--batch 1] [--models resnet50,mobilenet_v2]
        [--threads 2] [--iters 10] [--repeat 1] [--dir /tmp/convbench]

Several graphrun builds (comma-separated), each with every `--tunes` setting (`graphrun
--tune`; e.g. `cpu_conv_panels=0,cpu_conv_panels=1`), are timed in turn after ONNX Runtime,
each row `--repeat` times: on a noisy machine the rows show the spread.

Needs torch, torchvision, onnxruntime and numpy.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import time

import numpy as np


def export(name, path):
    import torch
    import torchvision
    m = getattr(torchvision.models, name)(weights=None).eval()
    x = torch.randn(2, 3, 224, 224)
    torch.onnx.export(m, (x,), path, dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "batch"}})


def ort_ms(path, batch, threads, iters):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    for _ in range(3):
        s.run(None, {"x": x})
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        s.run(None, {"x": x})
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def graphrun_ms(exe, tune, path, batch, threads, iters):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run([exe, "bench", path, "--backend", "cpu", "--dim", f"batch={batch}",
                          "--iters", str(iters), "--warmup", "3"]
                         + (["--tune", tune] if tune else []), capture_output=True,
                         text=True, env=env)
    m = re.search(r"median ([0-9.]+) ms", out.stdout)
    if not m:
        raise SystemExit(f"graphrun bench failed: {out.stdout}\n{out.stderr}")
    return float(m.group(1)), out.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graphrun", default="target/release/graphrun")
    ap.add_argument("--tunes", default="")
    ap.add_argument("--models", default="resnet50,mobilenet_v2")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dir", default="/tmp/convbench")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    exes = [(e, t) for e in a.graphrun.split(",") for t in a.tunes.split(",")]
    rows = []
    names = " | ".join(f"{os.path.basename(e)}{' ' + t if t else ''} ms | / ORT" for e, t in exes)
    print(f"| model | batch | ORT ms | {names} |")
    print("|---|---|---|" + "---|---|" * len(exes))
    for name in a.models.split(","):
        path = os.path.join(a.dir, f"{name}.onnx")
        if not os.path.exists(path):
            export(name, path)
        for b in [int(v) for v in a.batch.split(",")]:
            for _ in range(a.repeat):
                o = ort_ms(path, b, a.threads, a.iters)
                cells, top = [], []
                for e, tune in exes:
                    g, text = graphrun_ms(e, tune, path, b, a.threads, a.iters)
                    rows.append({"model": name, "batch": b, "graphrun": e, "tune": tune,
                                 "ort_ms": o, "graphrun_ms": g})
                    cells.append(f"{g:.2f} | {g / o:.2f}")
                    top = [l for l in text.splitlines()
                           if re.match(r"\s+\S+\s+\S+\s+[0-9.]+\s+[0-9.]+%", l)]
                print(f"| {name} | {b} | {o:.2f} | " + " | ".join(cells) + " |", flush=True)
                if a.repeat == 1:
                    for l in top[:6]:
                        print("    " + l.strip())
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
