#!/usr/bin/env bash
# ResNet-50 forward on the device's GPU through WebGPU (NVIDIA's Vulkan driver) in f32
# and f16 beside CUDA in f32 and bf16, batch 1 and 32, with the TFLOP/s `graphrun bench`
# reports.
# Exports torchvision's ResNet-50 there (random weights, TorchScript exporter, opset 17,
# dynamic batch: scripts/cpu_conv_bench.py's export). Needs the carry of
# scripts/carry_ops.sh (run after device_ops.sh has unpacked it), or a graphrun given as
# GRAPHRUN, with the Vulkan loader .debs in DEST/gl (apt-get download libvulkan1) and
# scripts/nvidia_vulkan.sh beside this script.
#   bash DEST/device_resnet.sh [GRAPHRUN]
set -u
C=$(cd "$(dirname "$0")" && pwd)
EXE=${1:-/tmp/ops_x/graphrun}
. "$C/nvidia_vulkan.sh" "$C"
export GRAPHRUN_CUDA_CACHE=/tmp/kcache
M=/tmp/convbench/resnet50.onnx
mkdir -p /tmp/convbench
[ -f $M ] || python3 -c "
import sys; sys.path.insert(0, '$C')
from cpu_conv_bench import export
export('resnet50', '$M')" 2>&1 | grep -v -i warn
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$EXE doctor 2>&1 | grep -A2 -E "^ *wgpu|cudnn" | head -8
for b in 1 32; do
    for run in "wgpu f32" "wgpu f16" "cuda f32" "cuda bf16"; do
        set -- $run
        echo "== resnet50 batch $b --backend $1 --dtype $2"
        timeout 200 $EXE bench $M --backend $1 --dtype $2 --dim batch=$b --iters 10 --warmup 3 2>&1 |
            grep -v XDG | sed -n '2,4p;6,9p'
    done
done
