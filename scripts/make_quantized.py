"""Writes tests/fixtures/quantized/: a small float model (a strided Conv, ReLU, two
MatMuls) quantized by ONNX Runtime's tools in its three forms, with an input and ONNX
Runtime's output for each:

  dynamic.onnx  quantize_dynamic: DynamicQuantizeLinear, ConvInteger, MatMulInteger
  qoperator.onnx  quantize_static, QOperator: QLinearConv, QLinearMatMul
  qdq.onnx      quantize_static, QDQ: QuantizeLinear / DequantizeLinear around float ops

    python3 scripts/make_quantized.py [DIR]
"""
import os
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                      quantize_dynamic, quantize_static)

out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/quantized"
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
w = lambda *s, k=0.1: nh.from_array((rng.normal(size=s) * k).astype(np.float32))
graph = h.make_graph(
    [
        h.make_node("Conv", ["img", "wc"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        h.make_node("Relu", ["c"], ["cr"]),
        h.make_node("Flatten", ["cr"], ["cf"]),
        h.make_node("MatMul", ["cf", "w1"], ["h"]),
        h.make_node("Relu", ["h"], ["hr"]),
        h.make_node("MatMul", ["hr", "w2"], ["y"]),
    ],
    "quantized",
    [h.make_tensor_value_info("img", T.FLOAT, [2, 3, 8, 8])],
    [h.make_tensor_value_info("y", T.FLOAT, [2, 10])],
)
for name, t in [("wc", w(8, 3, 3, 3, k=0.2)), ("w1", w(128, 128)), ("w2", w(128, 10))]:
    t.name = name
    graph.initializer.append(t)
model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
model.ir_version = 8


class Calibration(CalibrationDataReader):
    def __init__(self):
        self.it = iter([{"img": rng.normal(size=(2, 3, 8, 8)).astype(np.float32)} for _ in range(4)])

    def get_next(self):
        return next(self.it, None)


with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "float.onnx")
    onnx.save(model, src)
    quantize_dynamic(src, f"{out}/dynamic.onnx", weight_type=QuantType.QInt8)
    for name, fmt in [("qoperator", QuantFormat.QOperator), ("qdq", QuantFormat.QDQ)]:
        quantize_static(src, f"{out}/{name}.onnx", Calibration(), quant_format=fmt)
x = rng.normal(size=(2, 3, 8, 8)).astype(np.float32)
np.save(f"{out}/img.npy", x)
for name in ["dynamic", "qoperator", "qdq"]:
    s = ort.InferenceSession(f"{out}/{name}.onnx", providers=["CPUExecutionProvider"])
    np.save(f"{out}/{name}.ort.npy", s.run(None, {"img": x})[0])
    print(name, sorted({n.op_type for n in onnx.load(f"{out}/{name}.onnx").graph.node}))
