#!/usr/bin/env python3
"""Vendors ONNX's own backend node tests for the ops graphrun supports into tests/onnx_node/,
so that tests/onnx_conformance.rs runs them without network access.

The onnx wheel ships onnx/backend/test/data/node/<case>/{model.onnx, test_data_set_0/...}.
    python3 -m pip download --no-deps --only-binary=:all: onnx==1.17.0 -d /tmp/onnxwheel
    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install /tmp/onnxwheel/onnx-1.17.0-*.whl
    /tmp/venv/bin/python scripts/vendor_onnx_node_tests.py /tmp/onnxwheel/onnx-1.17.0-*.whl

Kept: every case whose model is one node of an op graphrun implements (SPEC §2), at its
data sets. Left out, and listed in tests/onnx_node/DROPPED: cases over MAX_BYTES (their
smaller siblings test the same op and attributes). Function-expansion cases (`*_expanded`)
are left out: they test other ops' compositions, which the single-op cases already cover.
"""
import os
import shutil
import sys
import zipfile

import onnx

# SPEC §2's ONNX operators (graphrun's FusedMatMul and VarlenAttention are not ONNX ops).
SUPPORTED = set(
    """Add Sub Mul Div Pow Neg Exp Log Sqrt Reciprocal Abs Erf Relu Sigmoid Tanh Gelu
    LeakyRelu Clip Where Equal Less Greater Cast Identity MatMul Gemm Softmax LogSoftmax
    LayerNormalization ReduceSum ReduceMean ReduceMax Reshape Transpose Concat Split Slice
    Squeeze Unsqueeze Flatten Expand Gather Shape Constant Trilu SoftmaxCrossEntropyLoss
    Dropout Attention""".split()
)
MAX_BYTES = 64 * 1024
PREFIX = "onnx/backend/test/data/node/"


def main():
    wheel = sys.argv[1]
    dest = os.path.join(os.path.dirname(__file__), "..", "tests", "onnx_node")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    z = zipfile.ZipFile(wheel)
    cases = {}
    for name in z.namelist():
        if name.startswith(PREFIX) and not name.endswith("/"):
            case, rest = name[len(PREFIX):].split("/", 1)
            cases.setdefault(case, []).append((rest, name))
    kept, dropped = 0, []
    for case in sorted(cases):
        files = dict(cases[case])
        if "model.onnx" not in files:
            continue
        model = onnx.load_model_from_string(z.read(files["model.onnx"]))
        ops = [n.op_type for n in model.graph.node]
        if len(ops) != 1 or ops[0] not in SUPPORTED:
            continue
        size = sum(z.getinfo(n).file_size for n in files.values())
        if size > MAX_BYTES:
            dropped.append(f"{case}\t{ops[0]}\t{size} bytes, over the {MAX_BYTES}-byte limit for vendored cases")
            continue
        for rest, name in files.items():
            out = os.path.join(dest, case, rest)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "wb") as f:
                f.write(z.read(name))
        kept += 1
    with open(os.path.join(dest, "DROPPED"), "w") as f:
        f.write("".join(d + "\n" for d in dropped))
    with open(os.path.join(dest, "SOURCE"), "w") as f:
        f.write(f"onnx {onnx.__version__} wheel, {PREFIX}: {kept} cases vendored, {len(dropped)} dropped\n")
    print(f"{kept} cases vendored, {len(dropped)} dropped")


if __name__ == "__main__":
    main()
