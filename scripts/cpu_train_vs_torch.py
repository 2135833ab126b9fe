#!/usr/bin/env python3
"""CPU training steps: PyTorch eager against `graphrun bench --backward`, back to back on
the same machine with the same thread count: mlp_small (batch 64) and gpt_block at batch 1
× sequence 128 (or the --gpt-dims given).

The PyTorch side is the benchmark suite's `torch_reference.py` model and step (forward,
loss, backward, SGD lr 0.01, gradients set to None), imported from --torch-reference and
run on the CPU in f32 with torch.set_num_threads(--threads); graphrun runs the same
workloads' model files (models/mlp.yaml, models/gpt_block.yaml, whose training sections
are that step) with the dims bound.

    cargo build --release
    python3 scripts/cpu_train_vs_torch.py [--threads 2] [--iters 20]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def torch_ms(ref, workload, shapes, threads, iters):
    sys.path.insert(0, os.path.dirname(os.path.abspath(ref)))
    import torch
    import torch_reference as tr

    torch.set_num_threads(threads)
    case = tr.Case(workload, shapes, "f32", "train", "eager", "default", "cpu", 0)
    for _ in range(3):
        case._body()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        case._body()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def graphrun_ms(exe, model, dims, iters, out):
    cmd = [exe, "bench", os.path.join(ROOT, "models", f"{model}.yaml"), "--backward",
           "--iters", str(iters), "--json", out]
    for k, v in dims.items():
        cmd += ["--dim", f"{k}={v}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(out))["results"][0]["ms"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch-reference", default=os.path.join(ROOT, "..", "shared", "bench",
                                                              "torch_reference.py"))
    ap.add_argument("--graphrun", default=os.path.join(ROOT, "target", "release", "graphrun"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--gpt-dims", type=int, nargs=2, default=[1, 128], metavar=("BATCH", "SEQ"))
    a = ap.parse_args()
    b, t = a.gpt_dims
    cases = [
        ("mlp_small", "mlp", dict(batch=64, d_in=784, hidden=512, d_out=10), {"batch": 64}),
        ("gpt_block", "gpt_block", dict(batch=b, seq=t, d_model=1024, heads=16, mlp_ratio=4),
         {"batch": b, "seq": t}),
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpu_train.") as tmp:
        for w, model, shapes, dims in cases:
            p = torch_ms(a.torch_reference, w, shapes, a.threads, a.iters)
            g = graphrun_ms(a.graphrun, model, dims, a.iters, os.path.join(tmp, f"{w}.json"))
            label = f"{w} ({' x '.join(str(v) for v in dims.values())})"
            rows.append((label, p, g))
            print(f"{label}: PyTorch {p:.3f} ms, graphrun {g:.3f} ms, ratio {g / p:.2f}",
                  flush=True)
    print()
    print("| training step | PyTorch eager ms | graphrun ms | graphrun / PyTorch |")
    print("|---|---|---|---|")
    for w, p, g in rows:
        print(f"| {w} | {p:.3f} | {g:.3f} | {g / p:.2f} |")


if __name__ == "__main__":
    main()
