#!/usr/bin/env python3
"""BERT-base inference on the CPU: ONNX Runtime against `graphrun bench`, back to back on
the same machine, at the given batch sizes (sequence 128 unless --seq).

The model is `transformers`' BertModel with the bert-base configuration (12 layers,
hidden 768, 12 heads, intermediate 3072) and seeded random weights, exported as a user
would: torch.onnx.export(..., dynamo=False) at opset 17, inputs input_ids and
attention_mask with dynamic batch and sequence axes. Both runtimes get the same inputs
(seeded token ids, a full attention mask); ORT runs with optimization level all,
--threads intra-op threads, sequential execution; graphrun with its fusion passes.

    cargo build --release
    python3 scripts/bert_vs_ort.py [--batch 1 8] [--seq 128] [--threads 2] [--keep DIR]

Needs torch, transformers, onnx, onnxruntime and numpy. Prints medians and the ratio.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def export(path):
    import torch
    from transformers import BertConfig, BertModel

    class Named(torch.nn.Module):
        # The TorchScript exporter binds forward()'s parameters by position: a wrapper
        # taking exactly the two inputs, by name.
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            o = self.m(input_ids=input_ids, attention_mask=attention_mask)
            return o.last_hidden_state, o.pooler_output

    torch.manual_seed(0)
    model = Named(BertModel(BertConfig())).eval()  # the bert-base configuration
    ids = torch.randint(0, 30522, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(model, (ids, mask), path, input_names=["input_ids", "attention_mask"],
                      output_names=["last_hidden_state", "pooler_output"],
                      dynamic_axes={"input_ids": axes, "attention_mask": axes,
                                    "last_hidden_state": axes, "pooler_output": {0: "batch"}},
                      opset_version=17, dynamo=False)


def ort_ms(path, feeds, threads, iters):
    import onnxruntime as ort

    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
    for _ in range(3):
        s.run(None, feeds)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        s.run(None, feeds)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def graphrun_ms(exe, path, files, batch, seq, iters, out):
    cmd = [exe, "bench", path, "--dim", f"batch={batch}", "--dim", f"seq={seq}",
           "--iters", str(iters), "--json", out]
    for name, f in files.items():
        cmd += ["--input", f"{name}={f}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.load(open(out))["results"][0]["ms"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--graphrun", default=os.path.join(ROOT, "target", "release", "graphrun"))
    ap.add_argument("--keep", help="a folder to export the model into and keep it")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bert_vs_ort.") as tmp:
        d = a.keep or tmp
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "bert_base.onnx")
        if not os.path.exists(path):
            export(path)
        rows = []
        rng = np.random.default_rng(0)
        for b in a.batch:
            feeds = {"input_ids": rng.integers(0, 30522, (b, a.seq), dtype=np.int64),
                     "attention_mask": np.ones((b, a.seq), dtype=np.int64)}
            files = {}
            for name, v in feeds.items():
                files[name] = os.path.join(tmp, f"{name}_{b}.npy")
                np.save(files[name], v)
            o = ort_ms(path, feeds, a.threads, a.iters)
            g = graphrun_ms(a.graphrun, path, files, b, a.seq, a.iters,
                            os.path.join(tmp, f"gr_{b}.json"))
            rows.append((b, o, g))
            print(f"batch {b}: ORT {o:.2f} ms, graphrun {g:.2f} ms, ratio {g / o:.2f}",
                  flush=True)
    print()
    print(f"| BERT-base, seq {a.seq} | ORT ms | graphrun ms | graphrun / ORT |")
    print("|---|---|---|---|")
    for b, o, g in rows:
        print(f"| batch {b} | {o:.2f} | {g:.2f} | {g / o:.2f} |")


if __name__ == "__main__":
    main()
