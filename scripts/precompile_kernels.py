#!/usr/bin/env python3
"""Compiles cuda/*.cu here, exactly as src/backends/cuda/device.rs does on the device (same
sources, options and cache-file name), into DIR/kernels-<key>.cubin. Carried to the device
and named by GRAPHRUN_CUDA_CACHE=DIR, it saves the device the NVRTC compile (device time),
where the device's NVRTC has the same version (otherwise the key differs and it compiles).

  LD_LIBRARY_PATH=<dir of libnvrtc> NVRTC=<libnvrtc.so.13> python3 scripts/precompile_kernels.py DIR [sm_90a]"""
import ctypes, os, sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
files = ["common.cuh", "elementwise.cu", "reduce.cu", "shape.cu", "attention.cu", "flash.cu", "optimizer.cu"]
src = "\n".join(open(os.path.join(root, "cuda", f), encoding="utf-8").read() for f in files)
arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90a"
opts = [f"--gpu-architecture={arch}", "--std=c++17"]
lib = ctypes.CDLL(os.environ["NVRTC"])
major, minor = ctypes.c_int(), ctypes.c_int()
lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
h = 0xCBF29CE484222325
for b in src.encode() + " ".join(opts).encode() + f"nvrtc {major.value}.{minor.value}".encode():
    h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"graphrun.cu", 0, None, None) == 0
arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
if lib.nvrtcCompileProgram(prog, len(opts), arr) != 0:
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    sys.exit(log.value.decode())
n = ctypes.c_size_t()
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
cubin = ctypes.create_string_buffer(n.value)
lib.nvrtcGetCUBIN(prog, cubin)
os.makedirs(sys.argv[1], exist_ok=True)
out = os.path.join(sys.argv[1], f"kernels-{h:016x}.cubin")
open(out, "wb").write(cubin.raw[: n.value])
print(f"{out}: {n.value} bytes (nvrtc {major.value}.{minor.value}, {' '.join(opts)})")
