#!/usr/bin/env bash
# Fills DEST (default .carry-ops, git-ignored) for scripts/device_ops.sh: the test
# executables that exercise the operators on CUDA (test profile, stripped), this build's
# graphrun and a base build's (BASE_BIN, for the side-by-side benchmark), kernels
# precompiled for sm_90a for both, and ONNX's node tests (the device has no onnx wheel).
#   BASE_BIN=/path/to/base/graphrun BASE_TREE=/path/to/base/checkout scripts/carry_ops.sh [DEST]
# Run on the device (run tool, carry [DEST]) as  bash DEST/device_ops.sh [tests] [bench]
set -eu
cd "$(dirname "$0")/.."
DEST=${1:-.carry-ops}
TESTS=${TESTS:-"op_matrix runtime_shapes onnx_conformance cuda ops_elementwise ops_grad grad zoo"}
rm -rf "$DEST" && mkdir -p "$DEST"
TESTS="$TESTS" BASE_BIN="${BASE_BIN:-}" scripts/pack_bin.sh "$DEST"
# The node suite of the pip-installed onnx wheel.
NODE=$(python3 -c "import onnx, os; print(os.path.join(os.path.dirname(onnx.__file__), 'backend/test/data/node'))")
tar cf - -C "$(dirname "$NODE")" node | xz -T2 -6 > "$DEST/node.txz"
# Kernels for sm_90a, this build's and the base's (each tree's sources hash to its own keys).
NV=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13/lib'))" 2>/dev/null || true)
if [ -n "$NV" ] && [ -e "$NV/libnvrtc.so.13" ]; then
    for tree in . ${BASE_TREE:-}; do
        LD_LIBRARY_PATH=$NV NVRTC=$NV/libnvrtc.so.13 python3 "$tree/scripts/precompile_kernels.py" "$DEST/kcache" >/dev/null
    done
fi
cp scripts/device_ops.sh "$DEST/"
du -sh "$DEST"
