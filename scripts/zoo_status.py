#!/usr/bin/env python3
"""Runs graphrun on every export of tests/fixtures/zoo/ and writes what it measured:
docs/MODELS.md (the table users read) and tests/fixtures/zoo/STATUS.tsv (what
tests/zoo.rs expects: which exports run, and why the others do not).

    cargo build --release
    python3 scripts/zoo_status.py [--graphrun PATH] [--fold-static]
    python3 scripts/zoo_status.py --backend wgpu|cuda [--graphrun PATH] [--only ARCH,ARCH]

Needs numpy only (no torch). For each export: `graphrun model.onnx --input NAME=FILE.npy
... --out-dir DIR` on the CPU, each output against the stored reference (ONNX Runtime's,
relative error ||out - ref|| / ||ref|| <= 1e-4); then the same with `--backward`, the
first output seeded with the stored seed and the others with zeros, each gradient against
PyTorch's float64 one (<= 1e-4, the norm in the denominator at least 1% of the export's
largest gradient norm: see GRAD_FLOOR).

With `--backend wgpu` or `--backend cuda` the same measurement runs on that backend and is
written to tests/fixtures/zoo/STATUS.<backend>.tsv only; the CPU run (the default) reads
those files and gives each backend its column in docs/MODELS.md.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ZOO = os.path.join(ROOT, "tests", "fixtures", "zoo")
TOL = 1e-4
ARCH_ORDER = ["gpt2", "llama", "mistral", "qwen2", "phi3", "gemma", "gpt_neox", "opt", "bloom",
              "bert", "distilbert", "roberta", "albert", "t5_encoder", "vit", "swin",
              "whisper_encoder", "wav2vec2", "mobilenet_v2", "mobilenet_v3", "efficientnet",
              "resnet", "convnext", "lraspp", "lstm_lm", "gru_encoder"]


def rel_err(got, want, floor=0.0):
    """||got - want|| / max(||want||, floor)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), floor, 1e-30))


# Some gradients are zero in exact arithmetic (a key projection's bias shifts every score
# of a softmax row equally): PyTorch's float64 gives ~1e-15 there and float32 ~1e-6, so
# each gradient's error is measured against at least this fraction of the largest
# gradient's norm of the same export.
GRAD_FLOOR = 1e-2


def read_manifest(d):
    rows = []
    for line in open(os.path.join(d, "MANIFEST")).read().splitlines():
        kind, value, f = line.split("\t")
        rows.append((kind, value, os.path.normpath(os.path.join(d, f))))
    return rows


def first_line(text):
    """graphrun's first line, without the `error: <model path>: ` prefix."""
    for l in text.splitlines():
        l = l.strip()
        # Mesa's software Vulkan driver complains on stderr where no desktop session runs.
        if l and "XDG_RUNTIME_DIR" not in l:
            return re.sub(r"^error: \S*model\.onnx: ", "", l)
    return "(no message)"


def missing_ops(msg):
    """The op names of graphrun's 'does not support N ops of this model (...): Op (k
    nodes: ...); Op2 (...)' error, else []."""
    m = re.search(r"does not support \d+ ops? of this model \([^)]*\): (.*)", msg)
    if not m:
        return []
    return re.findall(r"(?:^|; )([A-Za-z0-9_.:]+) \(\d+ nodes?", m.group(1))


BACKEND = "cpu"
OTHER_BACKENDS = [("wgpu", "WebGPU"), ("cuda", "CUDA")]
BACKEND_WHERE = {"wgpu": " with Mesa's software Vulkan driver, lavapipe, as CI runs it",
                 "cuda": " on an NVIDIA H200 (the Phi-3 rows on an H100)"}


def run_graphrun(exe, model, inputs, out, extra=()):
    cmd = [exe, model] + [a for n, f in inputs for a in ("--input", f"{n}={f}")]
    cmd += ["--out-dir", out, "--quiet", "--backend", BACKEND] + list(extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stderr + p.stdout


def measure(exe, case, tmp):
    """(forward, backward, detail, ops): forward is 'runs', 'fails' or 'mismatch';
    backward 'ok', 'fails', 'mismatch' or '-'."""
    d = os.path.join(ZOO, case)
    rows = read_manifest(d)
    model = os.path.join(d, "model.onnx")
    inputs = [(v, f) for k, v, f in rows if k == "input"]
    outputs = [(v, f) for k, v, f in rows if k == "output"]
    out = os.path.join(tmp, case)
    rc, text = run_graphrun(exe, model, inputs, out)
    if rc != 0:
        msg = first_line(text)
        return "fails", "-", msg, missing_ops(msg), None, None
    worst = 0.0
    for v, f in outputs:
        got = os.path.join(out, f"{v}.npy")
        if not os.path.exists(got):
            return "mismatch", "-", f"no output file for {v}", [], None, None
        e = rel_err(np.load(got), np.load(f))
        worst = max(worst, e)
        if not e <= TOL:
            return "mismatch", "-", f"output {v}: relative error {e:.1e} > {TOL:.0e}", [], e, None
    # Backward: the stored seed for the first output, zeros for the others, so the
    # differentiated scalar is the one PyTorch's gradients are of.
    seeds = []
    for k, v, f in rows:
        if k == "seed":
            seeds.append((v, f))
    for v, f in outputs[1:]:
        z = os.path.join(tmp, f"{case}.zero.{len(seeds)}.npy")
        np.save(z, np.zeros_like(np.load(f)))
        seeds.append((v, z))
    bout = os.path.join(tmp, case + ".bwd")
    extra = ["--backward"] + [a for v, f in seeds for a in ("--grad", f"{v}={f}")]
    rc, text = run_graphrun(exe, model, inputs, bout, extra)
    if rc != 0:
        return "runs", "fails", first_line(text), missing_ops(first_line(text)), worst, None
    gdir = os.path.join(bout, "grads")

    def grad(name):
        p = os.path.join(gdir, f"{name}.npy")
        return np.load(p) if os.path.exists(p) else None

    gworst, checked = 0.0, 0
    grows = [(k, v, f) for k, v, f in rows if k in ("grad", "grad_t", "grad_sum")]
    # PyTorch stores no gradient for a parameter the differentiated output does not
    # depend on (BERT's pooler under the first output): its gradient is zero.
    stored = [f for _, _, f in grows if os.path.exists(f)]
    floor = GRAD_FLOOR * max([np.linalg.norm(np.load(f)) for f in stored] + [0.0])
    for k, v, f in grows:
        want = np.load(f) if os.path.exists(f) else None
        if k == "grad_sum":
            total = 0
            for part in v.split(","):
                t = part.startswith("T:")
                g = grad(part[2:] if t else part)
                if g is None:
                    return "runs", "mismatch", f"no gradient for {part}", [], worst, None
                total = total + (g.T if t else g)
            got = total
        else:
            got = grad(v)
            if got is None:
                return "runs", "mismatch", f"no gradient for {v}", [], worst, None
            if k == "grad_t":
                got = got.T
        if want is None:
            want = np.zeros_like(got)
        e = rel_err(got, want, floor)
        checked += 1
        gworst = max(gworst, e)
        if not e <= TOL:
            return "runs", "mismatch", f"gradient of {v}: relative error {e:.1e} > {TOL:.0e}", [], worst, e
    return "runs", "ok", f"{checked} gradients", [], worst, gworst


TRAIN_STEPS = 30


def train_check(exe, case, tmp):
    """Whether the export trains: `graphrun train` with the cross-entropy graphrun appends
    to its first output (classes along the last axis, axis 1 of a 4-D output; seeded random
    labels, one a whole image for a 4-D output), on the
    reference's inputs as one batch, TRAIN_STEPS steps of Adam (lr 0.01). (status, first
    loss, last loss, message): status 'trains' when the last loss is under half the first,
    'flat' when it is not, 'fails' when graphrun stops with an error."""
    d = os.path.join(ZOO, case)
    rows = read_manifest(d)
    model = os.path.join(d, "model.onnx")
    inputs = [(v, f) for k, v, f in rows if k == "input"]
    out_name, out_file = [(v, f) for k, v, f in rows if k == "output"][0]
    logits = np.load(out_file)
    # Image-shaped scores ([N, C, H, W], a segmentation model's) have their classes on axis 1.
    axis = 1 if logits.ndim == 4 else logits.ndim - 1
    rng = np.random.default_rng(7)
    shape = logits.shape[:axis] + logits.shape[axis + 1:]
    labels = rng.integers(0, logits.shape[axis], size=shape, dtype=np.int64)
    if logits.ndim == 4:
        # One class a whole image: pixels labelled at random are noise that a few steps
        # cannot fit.
        labels = np.broadcast_to(labels[:, :1, :1], shape).copy()
    lf = os.path.join(tmp, f"{case}.labels.npy")
    np.save(lf, labels)
    data = inputs + [("labels", lf)]
    cmd = [exe, "train", model, "--cross-entropy", out_name, "--class-axis", str(axis),
           "--steps", str(TRAIN_STEPS),
           "--lr", "0.01", "--batch-size", str(logits.shape[0]), "--quiet",
           "--backend", BACKEND] + [a for n, f in data for a in ("--data", f"{n}={f}")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    text = p.stderr + p.stdout
    m = re.search(r"loss (\S+) -> (\S+)", text)
    if p.returncode != 0 or not m:
        return "fails", None, None, first_line(text)
    first, last = float(m.group(1)), float(m.group(2))
    ok = np.isfinite(last) and last < 0.5 * first
    return ("trains" if ok else "flat"), first, last, f"loss {first:.4g} -> {last:.4g}"


def fusion(exe, case):
    """What the passes made of the export, from `graphrun inspect`: the number of
    Attention, FusedMatMul, GatedMatMul, normalization (LayerNormalization,
    RMSNormalization, and their forms with the residual Add) and Rotary nodes, and of the MatMul/Gemm nodes left unfused.
    A model that cannot be loaded with symbolic sizes (a recurrence over a dynamic
    sequence axis is unrolled when it is loaded) is inspected for the reference's inputs."""
    d = os.path.join(ZOO, case)
    model = os.path.join(d, "model.onnx")
    p = subprocess.run([exe, "inspect", model], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        inputs = [a for k, v, f in read_manifest(d) if k == "input"
                  for a in ("--input", f"{v}={os.path.join(d, f)}")]
        p = subprocess.run([exe, "inspect", model] + inputs, capture_output=True, text=True,
                           timeout=600)
    m = re.search(r"^after passes: \d+ nodes: (.*)$", p.stdout, re.M)
    if p.returncode != 0 or not m:
        return None
    counts = {op: int(n) for op, n in re.findall(r"(\w+) (\d+)", m.group(1))}
    return (counts.get("Attention", 0), counts.get("FusedMatMul", 0),
            counts.get("GatedMatMul", 0),
            sum(counts.get(op, 0) for op in ("LayerNormalization", "RMSNormalization",
                                             "AddLayerNormalization", "AddRMSNormalization")),
            counts.get("Rotary", 0), counts.get("MatMul", 0) + counts.get("Gemm", 0))


def on_data(case, ops):
    """The ops of `ops` that some node of the export applies to values computed from the
    inputs' contents; the others only compute from shapes and constants (mask and
    position bookkeeping that graphrun could fold once the input shapes are known).
    Needs the onnx package; None without it."""
    try:
        import onnx
    except ImportError:
        return None
    g = onnx.load(os.path.join(ZOO, case, "model.onnx"), load_external_data=False).graph
    tainted = {i.name for i in g.input}
    found = set()
    for n in g.node:  # exporters write nodes in topological order
        hit = any(i in tainted for i in n.input)
        if hit and n.op_type in ops:
            found.add(n.op_type)
        if hit and n.op_type not in ("Shape", "Size"):
            tainted.update(n.output)
    return found


def fold_static(exe, tmp):
    """What-if, printed and not written anywhere: each failing export with its input
    shapes fixed to the reference's and its shape bookkeeping folded by ONNX Runtime's
    basic optimizer (constant folding only; it stays in the ai.onnx domain). Shows how
    much of the lacking-ops list folding at bind time would remove. Needs onnx and
    onnxruntime."""
    import onnx
    import onnxruntime as ort

    for line in open(os.path.join(ZOO, "STATUS.tsv")).read().splitlines()[1:]:
        case, fwd = line.split("\t")[:2]
        if fwd != "fails":
            continue
        d = os.path.join(ZOO, case)
        rows = read_manifest(d)
        inputs = [(v, f) for k, v, f in rows if k == "input"]
        shapes = {v: np.load(f).shape for v, f in inputs}
        m = onnx.load(os.path.join(d, "model.onnx"))
        for i in m.graph.input:
            for dim, n in zip(i.type.tensor_type.shape.dim, shapes[i.name]):
                dim.ClearField("dim_param")
                dim.dim_value = n
        src, out = os.path.join(tmp, f"{case}.static.onnx"), os.path.join(tmp, f"{case}.onnx")
        onnx.save(m, src)
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.optimized_model_filepath = out
        ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
        n_after = len(onnx.load(out).graph.node)
        rc, text = run_graphrun(exe, out, inputs, os.path.join(tmp, case + ".out"))
        if rc == 0:
            errs = [rel_err(np.load(os.path.join(tmp, case + ".out", f"{v}.npy")), np.load(f))
                    for k, v, f in rows if k == "output"]
            res = f"runs, matches the reference to {max(errs):.1e}"
        else:
            ops = missing_ops(first_line(text))
            res = "lacks " + ", ".join(ops) if ops else first_line(text)
        print(f"{case}: {len(m.graph.node)} -> {n_after} nodes: {res}", flush=True)


def parse_case(case):
    m = re.match(r"(.*)_(dynamo|torchscript)_op(\d+)(_mask)?$", case)
    return m.group(1), m.group(2), int(m.group(3)), bool(m.group(4))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graphrun", help="the binary (default: target/release/graphrun)")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "wgpu", "cuda"],
                    help="measure on this backend; other than cpu, write only "
                         "tests/fixtures/zoo/STATUS.<backend>.tsv")
    ap.add_argument("--fold-static", action="store_true",
                    help="only print what graphrun lacks once the failing exports' input "
                         "shapes are fixed and their shape computations folded (a what-if; "
                         "needs onnxruntime)")
    ap.add_argument("--only", metavar="ARCH,ARCH",
                    help="with --backend wgpu or cuda: measure these architectures only, "
                         "keeping the other rows of STATUS.<backend>.tsv")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    if only and a.backend == "cpu":
        sys.exit("--only needs --backend wgpu or cuda (the CPU run writes the whole table)")
    global BACKEND
    BACKEND = a.backend
    exe = a.graphrun or os.path.join(ROOT, "target", "release", "graphrun")
    if not os.path.exists(exe):
        sys.exit(f"{exe} not found: run `cargo build --release` first (or pass --graphrun)")
    if a.fold_static:
        with tempfile.TemporaryDirectory(prefix="zoo_fold.") as tmp:
            fold_static(exe, tmp)
        return
    manifest = [l.split("\t") for l in open(os.path.join(ZOO, "MANIFEST.tsv")).read().splitlines()[1:]]
    results = []
    tmp = tempfile.mkdtemp(prefix="zoo_status.")
    try:
        for case, exported, ort_ok, detail in manifest:
            arch, exporter, opset, mask = parse_case(case)
            if only and arch not in only:
                continue
            r = dict(case=case, arch=arch, exporter=exporter, opset=opset, mask=mask,
                     exported=exported == "yes", ort=ort_ok, ops=[])
            if exported != "yes":
                r.update(fwd="no-export", bwd="-", detail=detail)
            elif not os.path.exists(os.path.join(ZOO, case, "MANIFEST")):
                r.update(fwd="no-reference", bwd="-", detail=detail)
            else:
                fwd, bwd, msg, ops, e, ge = measure(exe, case, tmp)
                r.update(fwd=fwd, bwd=bwd, detail=msg, ops=ops, err=e, gerr=ge)
                if bwd == "ok":
                    st, l0, l1, tmsg = train_check(exe, case, tmp)
                    r.update(train=st, loss0=l0, loss1=l1, train_detail=tmsg)
                if BACKEND == "cpu":
                    r.update(data_ops=on_data(case, set(ops)),
                             fused=fusion(exe, case) if fwd == "runs" else None)
            print(f"{case}: {r['fwd']} / {r['bwd']} / {r.get('train', '-')}: {r['detail']}"
                  + (f"; {r['train_detail']}" if "train" in r else ""), flush=True)
            results.append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if BACKEND != "cpu":
        write_backend(results, keep=only is not None)
        return
    write_status(results)
    write_doc(results)


def write_backend(results, keep=False):
    """STATUS.<backend>.tsv: what the run on another backend measured, for the doc;
    with `keep`, the file's rows of the cases not measured stay."""
    path = os.path.join(ZOO, f"STATUS.{BACKEND}.tsv")
    rows = {}
    if keep and os.path.exists(path):
        for line in open(path).read().splitlines()[1:]:
            rows[line.split("\t")[0]] = line
    for r in results:
        num = lambda v: "-" if v is None else f"{v:.1e}"
        detail = r["detail"].replace("\t", " ")
        train = train_cell(r).replace("\t", " ")
        rows[r["case"]] = (f"{r['case']}\t{r['fwd']}\t{r['bwd']}\t{num(r.get('err'))}\t"
                           f"{num(r.get('gerr'))}\t{detail}\t{train}")
    with open(path, "w") as f:
        f.write("case\tforward\tbackward\toutput error\tgradient error\tdetail\ttraining\n")
        for case in sorted(rows):
            f.write(rows[case] + "\n")


def train_cell(r):
    """The 'trains' cell of one export: yes (first loss → last) or what went wrong."""
    st = r.get("train")
    if st is None:
        return "–"
    if st == "trains":
        return f"yes ({r['loss0']:.3g} → {r['loss1']:.3g})"
    if st == "flat":
        return f"no: {r['train_detail']} in {TRAIN_STEPS} steps"
    return "no: " + r["train_detail"]


def read_backends():
    """{backend: {case: (forward, backward, output error, gradient error, detail)}} of
    the STATUS.<backend>.tsv files present."""
    found = {}
    for b, _ in OTHER_BACKENDS:
        p = os.path.join(ZOO, f"STATUS.{b}.tsv")
        if os.path.exists(p):
            rows = [l.split("\t") for l in open(p).read().splitlines()[1:]]
            found[b] = {r[0]: r[1:] for r in rows}
    return found


def backend_cell(row):
    """One export on one backend: 'yes' when it runs and its outputs (and gradients, where
    the CPU's are checked) match, else what failed."""
    if row is None:
        return "not run"
    fwd, bwd, err, gerr, detail = row[:5]
    train = row[5] if len(row) > 5 else "–"
    if fwd == "runs" and bwd == "ok":
        if not train.startswith("yes"):
            return f"outputs and gradients match ({err} / {gerr}); training {train}"
        return f"yes ({err} / {gerr}; trains)"
    if fwd in ("no-export", "no-reference"):
        return "–"
    return "no: " + detail.replace("|", "\\|")


def write_status(results):
    with open(os.path.join(ZOO, "STATUS.tsv"), "w") as f:
        f.write("case\tforward\tbackward\tdetail\n")
        for r in sorted(results, key=lambda r: r["case"]):
            detail = r["detail"].replace("\t", " ")
            f.write(f"{r['case']}\t{r['fwd']}\t{r['bwd']}\t{detail}\n")


def write_doc(results):
    key = lambda r: (ARCH_ORDER.index(r["arch"]) if r["arch"] in ARCH_ORDER else 99,
                     r["mask"], r["exporter"] != "dynamo", r["opset"])
    results = sorted(results, key=key)
    total = len(results)
    exported = sum(r["exported"] for r in results)
    runs = sum(r["fwd"] == "runs" for r in results)
    bwd_ok = sum(r["bwd"] == "ok" for r in results)
    trains = sum(r.get("train") == "trains" for r in results)
    need = Counter()
    need_data = Counter()
    need_archs = defaultdict(set)
    for r in results:
        for op in r["ops"]:
            need[op] += 1
            need_archs[op].add(r["arch"])
            if r.get("data_ops") is not None and op in r["data_ops"]:
                need_data[op] += 1
    yn = {True: "yes", False: "no"}
    L = []
    L.append("# Exported models")
    L.append("")
    L.append("Which real architectures, exported from PyTorch to ONNX, graphrun runs. Each is a "
             "tiny configuration of the real `transformers` or `torchvision` class (2 layers, "
             "hidden size 32, random weights), or for the recurrent ones (`lstm_lm`: an "
             "embedding, a two-layer bidirectional `torch.nn.LSTM` and a linear head; "
             "`gru_encoder`: a `torch.nn.GRU` then a ReLU `torch.nn.RNN` over feature frames) "
             "a small `torch.nn` model, exported as a user would: the model itself, "
             "named inputs, dynamic batch (and, for text, sequence) axes, with "
             "`torch.onnx.export(..., dynamo=True)` at opsets 18 and 23 and "
             "`dynamo=False` (the TorchScript exporter) at opset 17; text models with "
             "`input_ids` alone and with `input_ids` + `attention_mask`. To keep the "
             "fixtures small, the text architectures after the first six (GPT-2, LLaMA, "
             "Mistral, BERT, DistilBERT, T5) keep three of their six exports: the dynamo "
             "exporter's at opset 18 with the mask and at opset 23 without it, and the "
             "TorchScript exporter's with the mask (and without it, where it exports); "
             "MobileNetV3 leaves out opset 23, and the LR-ASPP segmentation model keeps "
             "only the TorchScript export (which declares no intermediate shapes).")
    L.append("")
    L.append(f"**{runs} of {total} exports run** and match ONNX Runtime "
             f"({exported} of {total} exported; {total - exported} failed in the exporter). "
             f"Gradients match PyTorch's float64 ones for {bwd_ok} of the {runs} that run, "
             f"and {trains} of them train.")
    L.append("")
    others = read_backends()
    for b, name in OTHER_BACKENDS:
        if b in others:
            ok = sum(v[0] == "runs" and v[1] == "ok" for v in others[b].values())
            tr = sum(len(v) > 5 and v[5].startswith("yes") for v in others[b].values())
            L.append(f"On {name}: {ok} of the {runs} run with outputs and gradients matching, "
                     f"and {tr} train (the {name} column; `python3 scripts/zoo_status.py "
                     f"--backend {b}` measured it{BACKEND_WHERE[b]}).")
            L.append("")
    L.append("The models, their inputs, ONNX Runtime's outputs and PyTorch's gradients are in "
             "`tests/fixtures/zoo/` (made by `scripts/make_zoo.py`); `tests/zoo.rs` runs the "
             "ones marked as running on every backend. This page was written by")
    L.append("")
    L.append("```")
    L.append("cargo build --release")
    L.append("python3 scripts/zoo_status.py")
    L.append("```")
    L.append("")
    L.append("The script runs `graphrun MODEL.onnx --input NAME=FILE.npy ... --out-dir DIR` on the CPU "
             "for each export and compares every output with ONNX Runtime's (relative error "
             f"‖out − ref‖/‖ref‖ ≤ 1e-4), then runs it with `--backward`, the first output "
             "seeded with a fixed random tensor, and compares the gradients of the inputs and "
             f"weights with PyTorch's float64 ones (≤ 1e-4). The references are taken at "
             "another batch and sequence length than the export's sample, so a shape the "
             "exporter fixed shows up. `--graphrun PATH` picks another build of graphrun, such as the "
             "`target/debug/graphrun` that `cargo test` builds.")
    L.append("")
    L.append(f"\"trains\" is `graphrun train MODEL.onnx --cross-entropy OUTPUT`: the mean "
             "softmax cross-entropy that graphrun appends to the first output (classes along "
             "its last axis, or axis 1 of a segmentation model's `[N, C, H, W]` scores with "
             "`--class-axis 1`; seeded random labels, one class a whole image there), on the reference's inputs as one batch, "
             f"{TRAIN_STEPS} steps of Adam at learning rate 0.01; it trains when the last "
             "step's loss is under half the first's (the cell gives both). Every "
             "BatchNormalization uses the batch's statistics, as in PyTorch's `train()`.")
    L.append("")
    L.append("\"lacks\" lists the operators graphrun does not support (its error names them all at "
             "once); the number in parentheses is the relative error. `tests/fixtures/zoo/STATUS.tsv` "
             "has graphrun's whole message for each export.")
    L.append("")
    L.append("\"fused\" is what the passes made of the export (`graphrun inspect MODEL.onnx`, "
             "symbolic sizes; a recurrence over a dynamic sequence axis is unrolled when the "
             "model is loaded, so those exports are inspected with the reference's inputs): "
             "Attention nodes (each transformer has 2 attention blocks), "
             "FusedMatMul nodes, GatedMatMul nodes (the gated MLP of LLaMA-style models: "
             "its gate and up projections and their product, 1 per block), normalization nodes (LayerNormalization, or RMSNormalization "
             "for LLaMA and T5, whose exports spell it out as six elementwise ops, either "
             "with the residual Add before it where no matrix product took it; each "
             "transformer has 5), Rotary nodes (LLaMA's rotary position embedding of the "
             "queries and keys, 2 per block), and MatMul or Gemm nodes left unfused "
             "(`inspect --explain-fusion` says why each was left).")
    L.append("")
    others = read_backends()
    bcols = [(b, name) for b, name in OTHER_BACKENDS if b in others]
    head = "".join(f" {name} |" for _, name in bcols)
    L.append("| architecture | exporter | opset | mask | exports | runs | matches ORT | gradients | trains |"
             + head + " fused: Attention / FusedMatMul / GatedMatMul / norm / Rotary / MatMul left | graphrun's error, or why not |")
    L.append("|" + " --- |" * (11 + len(bcols)))
    for r in results:
        exp = yn[r["exported"]]
        if not r["exported"]:
            runs_c = match = grads = "–"
            why = "exporter: " + r["detail"]
        elif r["fwd"] == "no-reference":
            runs_c = match = grads = "–"
            why = "no reference: " + r["detail"]
        elif r["fwd"] == "fails":
            runs_c, match, grads = "no", "–", "–"
            why = f"lacks {', '.join(r['ops'])}" if r["ops"] else r["detail"]
        elif r["fwd"] == "mismatch":
            runs_c, match, grads = "yes", "no", "–"
            why = r["detail"]
        else:
            runs_c = "yes"
            match = f"yes ({r['err']:.0e})"
            grads = {"ok": f"yes ({r['gerr']:.0e})", "fails": "no", "mismatch": "no"}[r["bwd"]]
            why = "" if r["bwd"] == "ok" else "backward: " + r["detail"]
        if r["exported"] and not r["ort"].startswith("yes"):
            ort_msg = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", r["ort"][4:])
            ort_msg = re.sub(r"^Non-zero status code returned while running ", "", ort_msg)
            ort_msg = re.sub(r" Name:'[^']*' Status Message:", "", ort_msg)
            why += (("; " if why else "") + "ONNX Runtime fails, so the reference is "
                    "onnx.reference's: " + ort_msg)
        why = why.replace("|", "\\|")
        fz = r.get("fused")
        fused = " / ".join(str(v) for v in fz) if fz else "–"
        bcells = "".join(f" {backend_cell(others[b].get(r['case']))} |" for b, _ in bcols)
        L.append(f"| {r['arch']} | {r['exporter']} | {r['opset']} | {yn[r['mask']]} | {exp} | "
                 f"{runs_c} | {match} | {grads} | {train_cell(r)} |{bcells} {fused} | {why} |")
    L.append("")
    if need:
        L.append("## Operators graphrun lacks")
        L.append("")
        L.append("Each operator that stops an export from loading, with the number of exports "
                 "that use it (an export usually lacks several), the number of those where it "
                 "computes on the inputs' values rather than only on shapes and constants (the "
                 "attention-mask and position bookkeeping the exporters write from the input "
                 "shapes), and the number of exports that lack nothing else:")
        L.append("")
        L.append("| operator | exports | on values | architectures | exports it alone blocks |")
        L.append("| --- | --- | --- | --- | --- |")
        alone = Counter(r["ops"][0] for r in results if len(r["ops"]) == 1)
        for op, n in sorted(need.items(), key=lambda kv: (-kv[1], kv[0])):
            archs = ", ".join(sorted(need_archs[op], key=ARCH_ORDER.index))
            L.append(f"| {op} | {n} | {need_data.get(op, 0)} | {archs} | {alone.get(op, 0)} |")
        L.append("")
    with open(os.path.join(ROOT, "docs", "MODELS.md"), "w") as f:
        f.write("\n".join(L))


if __name__ == "__main__":
    main()
