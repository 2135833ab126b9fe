#!/bin/bash
# Device run of the WebGPU backend on the H100 through Vulkan: the attention, mlp_large and
# gpt_block benches (this build; a build of the base branch when carried; the attention
# tile size through --tune wgpu_attn_bk=N), then every WebGPU test executable with CI set
# (a missing adapter fails them). Needs the carry folder made by scripts/carry_wgpu.sh
# (Vulkan loader .debs in gl/, stripped executables in bins.tgz, the files the tests read
# in tree/). Usage on the device: bash .carry-wgpu/device_wgpu.sh [seconds for the tests]
C=$PWD/.carry-wgpu
. $C/nvidia_vulkan.sh $C
# The test executables read files under the worktree they were built in.
W=$(cat $C/worktree 2>/dev/null || echo /work/wt-wgpu)
mkdir -p $(dirname $W) && ln -sfn $C/tree $W
mkdir -p /tmp/bin && tar xzf $C/bins.tgz -C /tmp/bin && B=/tmp/bin && cd $W
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$B/graphrun doctor 2>&1 | grep -A2 wgpu:
# Median line, throughput line, and the LINES_ slowest nodes of the profile.
bench() {
  echo "== ${TAG:-} graphrun bench $* --iters 10 --warmup 2"
  timeout ${T_:-20} ${GR:-$B/graphrun} bench "$@" --iters 10 --warmup 2 2>&1 | grep -v XDG | head -$((5 + ${LINES_:-2})) | tail -n +2 | grep -v "peak memory\|node  "
}
bench models/attention.yaml --backend wgpu
LINES_=4 bench models/attention.yaml --backend wgpu --backward
for bk in 16 64; do TAG="BK=$bk" bench models/attention.yaml --backend wgpu --tune wgpu_attn_bk=$bk; done
LINES_=3 bench models/mlp_large.yaml --backend wgpu
LINES_=5 bench models/mlp_large.yaml --backend wgpu --backward
LINES_=3 bench models/gpt_block.yaml --backend wgpu
LINES_=5 bench models/gpt_block.yaml --backend wgpu --backward
if [ -x $B/graphrun_base ]; then
  export GR=$B/graphrun_base TAG=base
  bench models/attention.yaml --backend wgpu
  LINES_=3 bench models/gpt_block.yaml --backend wgpu
  LINES_=5 bench models/gpt_block.yaml --backend wgpu --backward
  unset GR TAG
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
