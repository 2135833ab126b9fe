#!/usr/bin/env bash
# One device call for training with BatchNormalization: the CUDA tests that
# scripts/carry_ops.sh carried (run as TESTS="training_state cuda ..."; with
# GRAPHRUN_REQUIRE_CUDA=1 they may not skip), then torchvision's ResNet-18 trained on the
# shapes set (scripts/make_shapes.py, made here) by `graphrun train --backend cuda` and by
# PyTorch on the same GPU (scripts/cnn_training.py), one after the other; `wgpu`:
# ResNet-50 forward (torchvision, random weights, TorchScript export, f32) on WebGPU
# (Vulkan) beside CUDA, batch 1 and 8, for their FLOP rates.
#   bash DEST/device_bn.sh [tests] [cnn] [wgpu]        (DEST is the carry folder)
set -u
C=$(cd "$(dirname "$0")" && pwd)
S=$(cd "$C/../scripts" && pwd)
OUT=${OUT:-/tmp/out}
X=/tmp/bn_x R=$OUT/bn
rm -rf "$X" && mkdir -p "$X" "$R" /tmp/kcache
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/bin.txz" "$X"
cp "$C"/kcache/*.cubin /tmp/kcache/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=/tmp/kcache
what=${*:-tests cnn wgpu}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ $what == *tests* ]]; then
    for t in $X/tests/*; do
        n=$(basename $t)
        timeout 300 $t --test-threads=4 > $R/test_$n.log 2>&1
        echo "== $n rc=$? $(grep -E '^test result' $R/test_$n.log | tail -n 1)"
        grep -E "^test .* FAILED$|panicked at" -A4 $R/test_$n.log | head -n 30
    done
fi
if [[ $what == *cnn* ]]; then
    D=/tmp/shapes
    python3 $S/make_shapes.py $D && python3 $S/cnn_training.py export /tmp/cnn 2>&1 | tail -n 1
    echo "== graphrun train --backend cuda"
    timeout 400 $X/graphrun train /tmp/cnn/resnet18.onnx --backend cuda --loss loss --epochs 10 --batch-size 32 \
        --data x=$D/train_x.npy --data labels=$D/train_y.npy \
        --val-data x=$D/val_x.npy --val-data labels=$D/val_y.npy -q 2>&1 | tail -n 12
    echo "== PyTorch (eager, cuda)"
    timeout 300 python3 $S/cnn_training.py torch $D --epochs 10 --device cuda 2>&1 | tail -n 10
fi
if [[ $what == *wgpu* ]]; then
    # The Vulkan loader (a .deb the carry holds in gl/, as scripts/carry_wgpu.sh fetches
    # it) and the NVIDIA driver's ICD.
    for f in $C/gl/*.deb; do dpkg -x $f /; done; ldconfig
    ICD=$(find /usr/local/nvidia /usr/share/vulkan /etc/vulkan -name "nvidia_icd*.json" 2>/dev/null | head -1)
    [ -n "$ICD" ] && export VK_DRIVER_FILES=$ICD
    python3 - <<'PY'
import torch, torchvision, warnings
warnings.filterwarnings("ignore")
m = torchvision.models.resnet50(weights=None).eval()
torch.onnx.export(m, (torch.randn(2, 3, 224, 224),), "/tmp/resnet50.onnx", dynamo=False,
                  opset_version=17, input_names=["x"], output_names=["logits"],
                  dynamic_axes={"x": {0: "batch"}})
print("exported /tmp/resnet50.onnx")
PY
    for b in 1 8; do
        for be in cuda wgpu; do
            echo "== ResNet-50 forward f32, batch $b, $be"
            timeout 200 $X/graphrun bench /tmp/resnet50.onnx --backend $be --dim batch=$b --iters 20 --warmup 5 \
                --json $R/resnet50_${be}_b$b.json 2>&1 | grep -E "median|TFLOP|error" | head -n 4
        done
    done
fi
