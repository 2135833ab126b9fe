#!/usr/bin/env python3
"""Exports the small PyTorch models of tests/fixtures/onnx/ with both ONNX exporters and
writes PyTorch's float64 reference outputs and gradients beside each .onnx file.

Run where PyTorch, onnx and onnxruntime are installed (the device machine):
    python3 scripts/export_onnx_fixtures.py OUT_DIR
It writes OUT_DIR/<model>_<exporter>/ with
    model.onnx               static shapes, default opset of that exporter
    in_<i>.npy               the inputs, in the order of the ONNX graph inputs
    out_<i>.npy              PyTorch's float64 outputs, in the order of the graph outputs
    seed_<i>.npy             the gradient seed of output i (d loss / d output)
    grad_<j>.npy             float64 gradient of sum_i <seed_i, out_i> w.r.t. a value
    MANIFEST                 one line per file: kind<TAB>ONNX value name<TAB>file
and OUT_DIR/REPORT.txt: torch/onnx versions, each model's ops, onnxruntime's agreement.

Gradients are PyTorch's, taken in float64 from a copy of the float32 model, with respect
to the float inputs and every parameter. Each parameter is matched to the ONNX initializer
that holds it: by name, else by value, else by transposed value (the TorchScript exporter
folds `weight.T` of a Linear into a new initializer).
"""
import copy
import math
import os
import sys
import traceback
from collections import Counter

import numpy as np
import onnx
import onnx.numpy_helper
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """A GPT-2 style pre-LayerNorm block: one fused qkv projection, causal attention,
    an output projection, a GELU MLP, two residuals."""

    def __init__(self, d=16, heads=2, seq=8, sdpa=False):
        super().__init__()
        self.h, self.sdpa = heads, sdpa
        self.ln1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * d, d)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))
        # As after training: LayerNorm parameters that differ from each other (the
        # exporters merge initializers of equal value, which would merge ln1 and ln2).
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.normal_(0.0, 0.1)

    def attn(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.h, c // self.h).transpose(1, 2)
        k = k.view(b, t, self.h, c // self.h).transpose(1, 2)
        v = v.view(b, t, self.h, c // self.h).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(self.gelu(self.fc(self.ln2(x))))


class EmbedCe(nn.Module):
    """Token embedding, a linear head and the mean cross-entropy loss."""

    def __init__(self, vocab=50, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens, targets):
        logits = self.head(self.emb(tokens))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def models():
    g = torch.Generator().manual_seed(1)
    x_mlp = torch.randn(4, 16, generator=g)
    x_blk = torch.randn(2, 8, 16, generator=g)
    tok = torch.randint(0, 50, (4, 8), generator=g)
    tgt = torch.randint(0, 50, (4, 8), generator=g)
    yield "mlp_gelu", Mlp(), (x_mlp,), ["x"], ["y"]
    yield "gpt_block_explicit", Block(sdpa=False), (x_blk,), ["x"], ["y"]
    yield "gpt_block_sdpa", Block(sdpa=True), (x_blk,), ["x"], ["y"]
    yield "embed_ce", EmbedCe(), (tok, tgt), ["tokens", "targets"], ["loss"]


# (case suffix, dynamo, opset): each exporter at its default opset, and the TorchScript
# exporter at opset 17 too, where GELU is written as its erf expansion.
EXPORTERS = [("dynamo", True, None), ("torchscript", False, None), ("torchscript17", False, 17)]


def export(model, args, names, outs, path, dynamo, opset):
    # Static shapes: no dynamic_axes / dynamic_shapes.
    kw = dict(input_names=names, output_names=outs, dynamo=dynamo)
    if opset is not None:
        kw["opset_version"] = opset
    torch.onnx.export(model, args, path, **kw)


def match_param(init, params):
    """The (parameter name, transposed?) that an ONNX initializer holds, if exactly one."""
    if init.name in params:
        return init.name, False
    a = onnx.numpy_helper.to_array(init)
    hits = []
    for name, p in params.items():
        pv = p.detach().numpy()
        if a.shape == pv.shape and np.array_equal(a, pv):
            hits.append((name, False))
        elif pv.ndim == 2 and a.shape == pv.T.shape and np.array_equal(a, pv.T):
            hits.append((name, True))
    return hits[0] if len(hits) == 1 else None


def references(model, args, m, seeds_rng):
    """Float64 outputs and gradients of the model for the ONNX graph's values."""
    m64 = copy.deepcopy(model).double()
    a64 = [a.double().requires_grad_() if a.is_floating_point() else a for a in args]
    out = m64(*a64)
    outs = out if isinstance(out, tuple) else (out,)
    seeds = [torch.from_numpy(seeds_rng.standard_normal(o.shape).astype(np.float32)) for o in outs]
    if outs[0].dim() == 0:
        seeds = [torch.ones((), dtype=torch.float32) for _ in outs]
    total = sum((o * s.double()).sum() for o, s in zip(outs, seeds))
    total.backward()
    grads = {}
    for inp, a in zip(m.graph.input, a64):
        if a.is_floating_point():
            grads[inp.name] = a.grad.numpy()
    params = dict(m64.named_parameters())
    params32 = dict(model.named_parameters())
    for init in m.graph.initializer:
        hit = match_param(init, params32)
        if hit is None:
            continue
        name, transposed = hit
        g = params[name].grad.numpy()
        grads[init.name] = np.ascontiguousarray(g.T if transposed else g)
    return [o.detach().numpy() for o in outs], seeds, grads


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    report = [f"torch {torch.__version__}, onnx {onnx.__version__}"]
    try:
        import onnxruntime as ort

        report.append(f"onnxruntime {ort.__version__}")
    except ImportError:
        ort = None
    for name, model, args, in_names, out_names in models():
        model.eval()
        for suffix, dynamo, opset in EXPORTERS:
            case = f"{name}_{suffix}"
            d = os.path.join(out_dir, case)
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, "model.onnx")
            try:
                export(model, args, in_names, out_names, path, dynamo, opset)
                m = onnx.load(path)
                ops = Counter(n.op_type for n in m.graph.node)
                opsets = {o.domain or "ai.onnx": o.version for o in m.opset_import}
                report.append(f"{case}: opsets {opsets}; {len(m.graph.node)} nodes: {dict(sorted(ops.items()))}")
                report.append(f"  inputs {[i.name for i in m.graph.input]} outputs {[o.name for o in m.graph.output]}")
                report.append(f"  initializers {[(i.name, list(i.dims)) for i in m.graph.initializer]}")
                outs, seeds, grads = references(model, args, m, np.random.default_rng(7))
                manifest = []
                for i, (vi, a) in enumerate(zip(m.graph.input, args)):
                    np.save(os.path.join(d, f"in_{i}.npy"), a.numpy())
                    manifest.append(("input", vi.name, f"in_{i}.npy"))
                for i, (vo, o, s) in enumerate(zip(m.graph.output, outs, seeds)):
                    np.save(os.path.join(d, f"out_{i}.npy"), o)
                    np.save(os.path.join(d, f"seed_{i}.npy"), s.numpy())
                    manifest.append(("output", vo.name, f"out_{i}.npy"))
                    manifest.append(("seed", vo.name, f"seed_{i}.npy"))
                for j, (v, g) in enumerate(grads.items()):
                    np.save(os.path.join(d, f"grad_{j}.npy"), g)
                    manifest.append(("grad", v, f"grad_{j}.npy"))
                with open(os.path.join(d, "MANIFEST"), "w") as f:
                    f.writelines(f"{k}\t{v}\t{p}\n" for k, v, p in manifest)
                params = dict(model.named_parameters())
                held = {h[0] for h in (match_param(i, params) for i in m.graph.initializer) if h}
                missing = sorted(set(params) - held)
                if missing:
                    report.append(f"  parameters without an initializer: {missing}")
                if ort is not None:
                    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
                    feeds = {vi.name: a.numpy() for vi, a in zip(m.graph.input, args)}
                    got = s.run(None, feeds)
                    errs = [float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)) for g, r in zip(got, outs)]
                    report.append(f"  onnxruntime vs torch f64: rel err {errs}")
            except Exception:
                report.append(f"{case}: FAILED\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, "REPORT.txt"), "w") as f:
        f.write("\n".join(report) + "\n")
    print("\n".join(report))


if __name__ == "__main__":
    main()
