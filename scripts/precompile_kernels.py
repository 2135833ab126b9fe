#!/usr/bin/env python3
"""Compiles the kernel families of cuda/ here, exactly as src/backends/cuda/device.rs does on
the device (each family's file after opcodes.cuh and common.cuh, the same options and cache-file names), into
DIR/<family>-<key>.cubin. Carried to the device and named by GRAPHRUN_CUDA_CACHE=DIR, it
saves the device the NVRTC compiles (device time), where the device's NVRTC has the same
version (otherwise the keys differ and each family compiles on its first use).

  LD_LIBRARY_PATH=<dir of libnvrtc> NVRTC=<libnvrtc.so.13> python3 scripts/precompile_kernels.py DIR [sm_90a]
  python3 scripts/precompile_kernels.py --keys ARCH "nvrtc M.m"   # prints "family key" lines
                                                                  # (device.rs's unit test compares)
  NVRTC=<libnvrtc.so.13> python3 scripts/precompile_kernels.py --ship DIR [ARCH ...]
      the kernels to ship beside the binary: put DIR next to graphrun as graphrun-kernels/
      (machine code for the default architectures sm_80 sm_89 sm_90a, and compute_80 PTX
      for other GPUs from 8.0 on, which their driver compiles); graphrun loads them before
      any NVRTC"""
import ctypes, os, sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# device.rs FAMILIES, in the same order.
FAMILIES = ["elementwise", "reduce", "shape", "attention", "flash", "flash_tf32", "optimizer"]


def read(f):
    return open(os.path.join(root, "cuda", f), encoding="utf-8").read()


def source(family):
    return read("opcodes.cuh") + "\n" + read("common.cuh") + "\n" + read(family + ".cu")


def key(src, opts, version):
    h = 0xCBF29CE484222325
    for b in src.encode() + " ".join(opts).encode() + version.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def options(arch):
    return [f"--gpu-architecture={arch}", "--std=c++17"]


def compile_family(lib, family, opts, ptx=False):
    prog = ctypes.c_void_p()
    name = f"{family}.cu".encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source(family).encode(), name, 0, None, None) == 0
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    if lib.nvrtcCompileProgram(prog, len(opts), arr) != 0:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(f"NVRTC failed on kernel family '{family}' (cuda/{family}.cu):\n{log.value.decode()}")
    n = ctypes.c_size_t()
    (lib.nvrtcGetPTXSize if ptx else lib.nvrtcGetCUBINSize)(prog, ctypes.byref(n))
    out = ctypes.create_string_buffer(n.value)
    (lib.nvrtcGetPTX if ptx else lib.nvrtcGetCUBIN)(prog, out)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    # PTX is text ending in a NUL, which the driver does not need.
    return out.raw[: n.value].rstrip(b"\0") if ptx else out.raw[: n.value]


if sys.argv[1] == "--ship":
    # Kernels shipped beside the binary, for each architecture given (default: A100,
    # L4/L40/RTX 40, H100): DIR/<family>-<arch>-<key>.cubin, the key over the source and
    # options only (device.rs shipped_file), so that any NVRTC version's machine code
    # is found; a driver that refuses one falls back to NVRTC.
    lib = ctypes.CDLL(os.environ["NVRTC"])
    out_dir = sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    # Machine code per architecture, then PTX (device.rs PTX_ARCH) for the GPUs from 8.0
    # on that have none.
    for arch in (sys.argv[3:] or ["sm_80", "sm_89", "sm_90a"]) + ["compute_80"]:
        opts = options(arch)
        ptx = arch.startswith("compute_")
        for f in FAMILIES:
            ext = "ptx" if ptx else "cubin"
            out = os.path.join(out_dir, f"{f}-{arch}-{key(source(f), opts, 'shipped'):016x}.{ext}")
            bin = compile_family(lib, f, opts, ptx)
            open(out, "wb").write(bin)
            print(f"{out}: {len(bin)} bytes", flush=True)
    sys.exit()
if sys.argv[1] == "--keys":
    for f in FAMILIES:
        print(f, f"{key(source(f), options(sys.argv[2]), sys.argv[3]):016x}")
    sys.exit()
arch = sys.argv[2] if len(sys.argv) > 2 else "sm_90a"
opts = options(arch)
lib = ctypes.CDLL(os.environ["NVRTC"])
major, minor = ctypes.c_int(), ctypes.c_int()
lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
version = f"nvrtc {major.value}.{minor.value}"
os.makedirs(sys.argv[1], exist_ok=True)
for f in FAMILIES:
    out = os.path.join(sys.argv[1], f"{f}-{key(source(f), opts, version):016x}.cubin")
    bin = compile_family(lib, f, opts)
    open(out, "wb").write(bin)
    print(f"{out}: {len(bin)} bytes ({version}, {' '.join(opts)})", flush=True)
