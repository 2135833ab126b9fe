#!/usr/bin/env bash
# CPU convolutions on the device's host, pinned to 2 cores (a quieter machine than the
# shared 2-core VM): ONNX Runtime (if installed) against this build's graphrun with each
# `--tune` setting of TUNES, ResNet-50 and MobileNetV2 at batch 1, REPS rows each.
#   [TUNES=KEY=VALUE,...] [REPS=3] bash scripts/device_cpu_conv.sh GRAPHRUN
set -u
EXE=${1:?graphrun executable}
lscpu | grep -E "Model name|^CPU\(s\)"
python3 -c "import onnxruntime, torch, torchvision; print('onnxruntime', onnxruntime.__version__, 'torch', torch.__version__)"
taskset -c 0,1 python3 "$(dirname "$0")/cpu_conv_bench.py" --graphrun "$EXE" \
    --tunes "${TUNES:-}" --batch 1 --iters 20 \
    --repeat "${REPS:-3}" --dir /tmp/convbench
