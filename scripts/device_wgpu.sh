#!/bin/bash
# Device run of the WebGPU backend on the H100 through Vulkan: the bare GEMM benches, the
# mlp_large f32 benches, then every WebGPU test executable with CI set (a missing adapter
# fails them). Needs the carry folder made by scripts/carry_wgpu.sh (Vulkan loader .debs
# in gl/, stripped executables in bins.tgz, the files the tests read in tree/).
# Usage on the device: bash .carry-wgpu/device_wgpu.sh [seconds for the tests]
C=$PWD/.carry-wgpu
for f in $C/gl/*.deb; do dpkg -x $f /; done; ldconfig
ICD=$(find /usr/local/nvidia /usr/share/vulkan /etc/vulkan -name "nvidia_icd*.json" 2>/dev/null | head -1)
[ -n "$ICD" ] && export VK_DRIVER_FILES=$ICD
mkdir -p /work && ln -sfn $C/tree /work/wt-wgpu
mkdir -p /tmp/bin && tar xzf $C/bins.tgz -C /tmp/bin && B=/tmp/bin && cd /work/wt-wgpu
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$B/graphrun doctor 2>&1 | grep -A2 wgpu:
bench() { echo "== graphrun bench $* --iters 10 --warmup 2"; timeout 20 ${GR:-$B/graphrun} bench "$@" --iters 10 --warmup 2 2>&1 | grep -v XDG | head -${LINES_:-4} | tail -n +2; }
bench models/gemm/gemm_2048.yaml --backend wgpu
bench models/gemm/gemm_mlp_large.yaml --backend wgpu
LINES_=8 bench models/gemm/gemm_mlp_large.yaml --backend wgpu --backward
LINES_=9 bench models/mlp_large.yaml --backend wgpu
LINES_=14 bench models/mlp_large.yaml --backend wgpu --backward
# The same build with every product on the earlier 64×64 kernel, for the comparison.
export GRAPHRUN_WGPU_GEMM=64
bench models/gemm/gemm_2048.yaml --backend wgpu
bench models/gemm/gemm_mlp_large.yaml --backend wgpu
unset GRAPHRUN_WGPU_GEMM
# A build of the branch this one started from, when carried (BASE= in carry_wgpu.sh).
if [ -x $B/graphrun_base ]; then
  echo "== base build:"
  GR=$B/graphrun_base bench models/mlp_large.yaml --backend wgpu
  GR=$B/graphrun_base bench models/mlp_large.yaml --backend wgpu --backward
fi
# The tests on wgpu only: CUDA hidden (the NVIDIA Vulkan driver does not read this).
export CI=1 CUDA_VISIBLE_DEVICES=
for t in $B/tests/*; do
  (timeout ${1:-60} $t --test-threads 4 > /tmp/$(basename $t).log 2>&1; echo "rc=$?" >> /tmp/$(basename $t).log) &
done
wait
for t in $B/tests/*; do
  n=$(basename $t); echo "== test $n: $(grep -E '^test result' /tmp/$n.log) $(tail -1 /tmp/$n.log)"
  grep -E "FAILED|panicked|rel err|failures:" /tmp/$n.log | head -6
done
