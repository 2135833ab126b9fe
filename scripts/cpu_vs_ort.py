#!/usr/bin/env python3
"""graphrun's CPU backend against ONNX Runtime on the four benchmark workloads, back to back
in one run on the same machine: ONNX Runtime's reference script (the workloads as unfused
ONNX graphs, optimization level all, --threads threads) then `graphrun bench` (fused,
forward, f32) for each workload, and the medians side by side with their ratio.

    cargo build --release
    python3 scripts/cpu_vs_ort.py [--ort-reference PATH] [--threads 2] [--workload mlp ...]

PATH is the benchmark suite's `ort_reference.py` (needs onnx, onnxruntime and numpy).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# graphrun's model file and ORT reference's workload name for each workload.
WORKLOADS = {"mlp": "mlp_small", "mlp_large": "mlp_large", "gpt_block": "gpt_block",
             "attention": "attention"}


def ort_ms(ref, workload, threads, out):
    subprocess.run([sys.executable, ref, "--workload", workload, "--opt-level", "all",
                    "--threads", str(threads), "--json", out], check=True,
                   stdout=subprocess.DEVNULL)
    return json.load(open(out))["results"][0]["ms"]


def graphrun_ms(exe, model, iters, out):
    subprocess.run([exe, "bench", os.path.join(ROOT, "models", f"{model}.yaml"),
                    "--iters", str(iters), "--json", out], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.load(open(out))["results"][0]["ms"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ort-reference", default=os.path.join(ROOT, "..", "shared", "bench",
                                                            "ort_reference.py"))
    ap.add_argument("--graphrun", default=os.path.join(ROOT, "target", "release", "graphrun"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", nargs="*", default=list(WORKLOADS))
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpu_vs_ort.") as tmp:
        for w in a.workload:
            o = ort_ms(a.ort_reference, WORKLOADS[w], a.threads, os.path.join(tmp, f"{w}.ort.json"))
            # About as many timed iterations as ORT's script takes at that speed.
            iters = 200 if o < 5 else 20 if o < 500 else 5
            g = graphrun_ms(a.graphrun, w, iters, os.path.join(tmp, f"{w}.gr.json"))
            rows.append((WORKLOADS[w], o, g))
            print(f"{WORKLOADS[w]}: ORT {o:.3f} ms, graphrun {g:.3f} ms, ratio {g / o:.2f}",
                  flush=True)
    print()
    print("| workload | ORT ms | graphrun ms | graphrun / ORT |")
    print("|---|---|---|---|")
    for w, o, g in rows:
        print(f"| {w} | {o:.3f} | {g:.3f} | {g / o:.2f} |")


if __name__ == "__main__":
    main()
