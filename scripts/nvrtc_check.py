#!/usr/bin/env python3
"""Compiles cuda/*.cu the way src/backends/cuda/device.rs does (one NVRTC program, opcodes.cuh and
common.cuh first) and, where ptxas is given, assembles the PTX for sm_90a (wgmma) and prints each kernel's
registers, spills and shared memory. Catches kernel compile errors without a GPU.

  NVRTC=/path/libnvrtc.so.13 PTXAS=/path/ptxas python3 scripts/nvrtc_check.py [filter]

(libnvrtc and ptxas come from the nvidia-cuda-nvrtc / nvidia-cuda-nvcc wheels.)"""
import ctypes, os, subprocess, sys, re

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
files = ["opcodes.cuh", "common.cuh", "elementwise.cu", "reduce.cu", "shape.cu", "attention.cu", "flash.cu", "flash_tf32.cu", "optimizer.cu"]
if os.environ.get("FILES"):  # e.g. FILES=common.cuh,attention.cu,flash.cu: a quicker check
    files = os.environ["FILES"].split(",")
src = "\n".join(open(os.path.join(root, "cuda", f)).read() for f in files if os.path.exists(os.path.join(root, "cuda", f)))
lib = ctypes.CDLL(os.environ["NVRTC"])
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"graphrun.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=compute_90a", b"--std=c++17"]
arr = (ctypes.c_char_p * len(opts))(*opts)
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
if log.value.strip():
    print(log.value.decode())
if rc != 0:
    sys.exit("NVRTC failed")
lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
ptx = ctypes.create_string_buffer(n.value)
lib.nvrtcGetPTX(prog, ptx)
open("/tmp/graphrun.ptx", "wb").write(ptx.value)
print(f"PTX ok: {len(ptx.value)} bytes -> /tmp/graphrun.ptx")
if os.environ.get("PTXAS"):
    r = subprocess.run([os.environ["PTXAS"], "-arch=sm_90a", "-v", "-o", "/tmp/graphrun.cubin", "/tmp/graphrun.ptx"],
                       capture_output=True, text=True)
    flt = sys.argv[1] if len(sys.argv) > 1 else ""
    cur = None
    for line in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
        if cur and flt in cur and ("registers" in line or "spill" in line):
            print(cur, line.split("info    :")[-1].strip())
    if r.returncode != 0:
        print(r.stderr[-3000:])
        sys.exit("ptxas failed")
