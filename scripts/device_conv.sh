#!/usr/bin/env bash
# One device call for the convolution work: the CUDA tests scripts/carry_ops.sh carried
# (GRAPHRUN_REQUIRE_CUDA=1), then ResNet-50 (torchvision, random weights) exported on the
# device by the TorchScript exporter (opset 17, dynamic batch) and timed with `graphrun
# bench` on CUDA in bf16 (forward at batch 1 and 32, forward + backward at batch 64) beside
# PyTorch eager from the bench reference script (carried as DEST/real_reference.py) in the
# same call (`torch`: eager and torch.compile; the compiles take most of a call).
#   [SKIP_TESTS="cuda ..."] [LIB_FILTER=cuda] [TUNES="- cuda_conv=cudnn ..."] bash DEST/device_conv.sh [tests] [bench] [torch]
set -u
C=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
X=/tmp/conv_x R=$OUT/conv
rm -rf "$X" && mkdir -p "$X" "$R" /tmp/kcache
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/bin.txz" "$X"
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/node.txz" "$X"
cp "$C"/kcache/*.cubin /tmp/kcache/ 2>/dev/null
[ -e "$C/kcache.txz" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/kcache.txz" /tmp
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=/tmp/kcache GRAPHRUN_ONNX_NODE_TESTS=$X/node
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
mkdir -p /work/main/target/release /work/main/target/debug
cp $X/graphrun /work/main/target/release/graphrun && cp $X/graphrun /work/main/target/debug/graphrun
what=${*:-tests bench torch}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ $what == *tests* ]]; then
    for t in $X/tests/*; do
        n=$(basename $t)
        [[ " ${SKIP_TESTS:-} " == *" $n "* ]] && continue
        # The library's unit tests (carried as "lib"): those LIB_FILTER names.
        filter=; [ $n = graphrun ] && filter=${LIB_FILTER:-cuda}
        (cd /work/main && timeout 300 $t $filter --test-threads=4 > $R/test_$n.log 2>&1)
        echo "== $n rc=$? $(grep -E '^test result' $R/test_$n.log | tail -n 1)"
        grep -E "^test .* FAILED$|panicked at" -A4 $R/test_$n.log | head -n 30
    done
fi
if [[ $what == *bench* ]]; then
    python3 - <<'PY'
import torch, torchvision
m = torchvision.models.resnet50(weights=None).eval()
x = torch.randn(2, 3, 224, 224)
torch.onnx.export(m, (x,), "/tmp/resnet50.onnx", dynamo=False, opset_version=17,
                  input_names=["x"], output_names=["logits"], dynamic_axes={"x": {0: "batch"}})
print("exported /tmp/resnet50.onnx")
PY
    # cuDNN (the default where it is found), and the Im2Col + cuBLASLt path beside it
    # (TUNES); this build and, where carried, the base build's (graphrun_base) in turn.
    # "-" is each build's defaults; a KEY=VALUE row runs this build alone (the base build
    # may not know the key).
    for tune in ${TUNES:-- cuda_conv=cudnn cuda_conv=columns}; do
        for G in $X/graphrun $X/graphrun_base; do
            [ -x $G ] || continue
            g=$(basename $G)
            [ $g = graphrun_base ] && [ "$tune" != - ] && continue
            tflag=; [ "$tune" != - ] && tflag="--tune $tune"
            echo "== $g $tune"
            for b in 1 32; do
                timeout 150 $G bench /tmp/resnet50.onnx --backend cuda --dtype bf16 --dim batch=$b --iters 20 --warmup 5 \
                    $tflag 2>&1 | head -n ${TOP:-16}
            done
            timeout 200 $G bench /tmp/resnet50.onnx --backend cuda --dtype bf16 --dim batch=64 --backward --iters 10 --warmup 3 \
                $tflag 2>&1 | head -n ${TOP:-16}
        done
    done
fi
if [[ $what == *torch* ]]; then
    timeout 500 python3 $C/real_reference.py --workload resnet50,resnet50_b1,resnet50_b32 --dtype bf16 \
        --pass fwd,train --mode eager,compile --json $R/torch.json 2>&1 | tail -n 8
fi
