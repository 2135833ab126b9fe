#!/usr/bin/env bash
# Fills DEST (default ../main/.carry-cuda, git-ignored there) with what
# scripts/device_cuda.sh needs on the device: stripped test executables and graphrun
# (bin.txz), kernels precompiled for sm_90a, torch_reference.py and the table script. The
# files the tests read travel with the checkout itself.
set -eu
cd "$(dirname "$0")/.."
DEST=${1:-../main/.carry-cuda}
cargo build --release
cargo test --release --no-run --message-format=json 2>/dev/null | python3 -c '
import sys, json
for l in sys.stdin:
    try: j = json.loads(l)
    except ValueError: continue
    if j.get("executable") and j.get("profile", {}).get("test"): print(j["executable"])
' > /tmp/carry_cuda_exes.txt
rm -rf "$DEST" /tmp/carry_cuda_bin && mkdir -p "$DEST" /tmp/carry_cuda_bin/tests
# Only the test executables with CUDA cases travel (the rest run in CI; 64 MiB limit).
# BENCH_ONLY=1 leaves them out (a carry for `bench torch` alone: the tests and the
# benchmarks no longer fit one 64 MiB carry, so they go in two calls).
GPU_TESTS=" wgpu cuda cuda_3xtf32 cuda_f32_simt cli parallel onnx_conformance onnx_models ops_attention ops_attention_grad ops_elementwise ops_grad ops_matmul ops_misc ops_reduce ops_shape "
[ -n "${BENCH_ONLY:-}" ] && GPU_TESTS=" "
for f in $(cat /tmp/carry_cuda_exes.txt); do
    n=$(basename "$f"); n=${n%-*}
    [[ $GPU_TESTS == *" $n "* ]] || continue
    [ -e /tmp/carry_cuda_bin/tests/$n ] && n=${n}_main
    cp "$f" /tmp/carry_cuda_bin/tests/$n
done
cp "${CARGO_TARGET_DIR:-target}/release/graphrun" /tmp/carry_cuda_bin/graphrun
strip /tmp/carry_cuda_bin/graphrun $(ls /tmp/carry_cuda_bin/tests/* 2>/dev/null)
# xz: the test executables no longer fit 64 MiB gzipped (the device unpacks with Python).
rm -f "$DEST/bin.tgz" "$DEST/bin.txz"
tar cf - -C /tmp/carry_cuda_bin . | xz -T2 -6 > "$DEST/bin.txz"
cp scripts/device_cuda.sh scripts/bench_table.py "$DEST/"
# Where these executables were built: they embed the checkout (CARGO_MANIFEST_DIR) and
# graphrun's path (CARGO_BIN_EXE_graphrun), which device_cuda.sh recreates there.
echo "ROOT=$PWD TARGET=${CARGO_TARGET_DIR:-$PWD/target}" > "$DEST/paths.env"
# The Vulkan loader for the WebGPU tests and benches on the same GPU (device README).
if [ ! -d "$DEST/gl" ]; then
    mkdir -p "$DEST/gl" /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    [ -d /work/main/.carry-wgpu/gl ] && cp /work/main/.carry-wgpu/gl/*.deb "$DEST/gl/" ||
        { apt-get $o update -qq; (cd "$DEST/gl" && apt-get $o download libvulkan1); }
fi
# The kernels compiled here for sm_90a (saves the device the first-run NVRTC compile).
NV=/tmp/nv/x/nvidia/cu13/lib
[ -z "${NVRTC:-}" ] && [ -e $NV/libnvrtc.so.13 ] && export NVRTC=$NV/libnvrtc.so.13 LD_LIBRARY_PATH=$NV:${LD_LIBRARY_PATH:-}
python3 scripts/precompile_kernels.py "$DEST/kcache" || echo "no precompiled kernels (NVRTC not found here)"
cp ../shared/bench/torch_reference.py "$DEST/"
du -sh "$DEST"
