#!/usr/bin/env bash
# One device call (the `run` tool, kind nvidia-h100-x2 or nvidia-h200-x2) for
# data-parallel training: the data-parallel tests on 2 GPUs (none may skip) and the
# training tests on CUDA (gradient accumulation among them), then gpt_block bf16 train
# steps on 1 and 2 GPUs with graphrun (`bench --backward --gpus N`, also with the
# optimizer sharded) and with PyTorch DDP (torchrun), same per-GPU batch. Build here
# first (scripts/carry_nccl.sh fills .carry-nccl/), then
#   [GPUS="1 2 4"] bash .carry-nccl/device_nccl.sh [tests] [bench] [ddp] [torchrun] [tune]     (default: tests bench ddp)
# NVLink multicast stays off (the device README demands it).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
C=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/x /tmp/kcache
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/bin.txz" /tmp/x
cp "$C"/kcache/*.cubin /tmp/kcache/ 2>/dev/null
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
mkdir -p /work/main/target/release /work/main/target/debug
cp /tmp/x/graphrun /work/main/target/release/graphrun && cp /tmp/x/graphrun /work/main/target/debug/graphrun
export GRAPHRUN_CUDA_CACHE=/tmp/kcache
G=/tmp/x/graphrun
what=${*:-tests bench ddp}
# The GPU counts benched (GPUS="1 2 4" on a 4-GPU machine); the last also sharded.
GPUS=${GPUS:-1 2}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
nvidia-smi topo -m 2>&1 | head -n 4
$G doctor 2>&1 | sed -n '/^cuda/,/^wgpu/p'
if $G doctor 2>&1 | grep -q "NCCL: unavailable"; then
    lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
    echo "graphrun did not find NCCL by itself; python's is at $lib"
    export GRAPHRUN_NCCL=$lib
fi
status=0
if [[ $what == *tests* ]]; then
    (cd /work/main && GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_REQUIRE_GPUS=${GPUS##* } timeout 400 /tmp/x/tests/parallel --test-threads=1 --nocapture) > $OUT/tests.log 2>&1
    rc=$?; [ $rc -ne 0 ] && status=1
    echo "== parallel tests rc=$rc"; grep -E "^test |test result|panicked|failure reported" -A2 $OUT/tests.log
    (cd /work/main && GRAPHRUN_REQUIRE_CUDA=1 timeout 300 /tmp/x/tests/training_state --test-threads=1) > $OUT/training.log 2>&1
    rc=$?; [ $rc -ne 0 ] && status=1
    echo "== training_state tests rc=$rc"; grep -E "^test |test result|panicked" -A2 $OUT/training.log
fi
if [[ $what == *bench* ]]; then
    # One GPU without data parallelism, then 1 and 2 workers through NCCL.
    for n in plain $GPUS ${SHARDED:-${GPUS##* }s}; do
        flag=; [ $n != plain ] && flag="--gpus ${n%s}"
        [ "${n%s}" != "$n" ] && flag="$flag --shard-optimizer"
        (cd /work/main && timeout 200 $G bench models/gpt_block.yaml --backend cuda --dtype bf16 \
            --backward $flag --iters 30 --warmup 5 --tune cuda_graphs_debug=1 \
            --json $OUT/graphrun_gpus$n.json) > /tmp/bench_$n.log 2>&1
        echo "== graphrun gpt_block bf16 train gpus=$n (rc=$?)"; grep -E "median|samples/s|optimizer state|error|not recorded" /tmp/bench_$n.log | head -n 6
    done
    # GPT-2 small's step (AdamW: its state is what sharding divides), batch 8 x 1024 a GPU.
    for n in ${GPT2_GPUS:-${GPUS##* } ${GPUS##* }s}; do
        flag="--gpus ${n%s}"; [ "${n%s}" != "$n" ] && flag="$flag --shard-optimizer"
        (cd /work/main && timeout 300 $G bench models/gpt2_124m.yaml --backend cuda --dtype bf16 \
            --backward $flag --iters 20 --warmup 3 --json $OUT/gpt2_gpus$n.json) > /tmp/gpt2_$n.log 2>&1
        echo "== graphrun gpt2_124m bf16 train gpus=$n (rc=$?)"; grep -E "median|samples/s|optimizer state|error" /tmp/gpt2_$n.log | head -n 6
    done
fi
if [[ $what == *torchrun* ]]; then
    # graphrun as torchrun starts it (its agent holds MASTER_PORT): 2 processes of
    # TR_GPUS GPUs each, against one process on all of them (the saved weights compared).
    tg=${TR_GPUS:-1}
    (cd /work/main && timeout 120 $G train models/mlp.yaml -q --backend cuda --steps 20 --batch-size 64 \
        --shard-optimizer --gpus $((2 * tg)) --save /tmp/one.safetensors) > $OUT/one_process.log 2>&1
    (cd /work/main && timeout 120 torchrun --standalone --nproc_per_node=2 --no-python $G train \
        models/mlp.yaml --backend cuda --steps 20 --batch-size 64 --shard-optimizer --gpus $tg \
        --save /tmp/many.safetensors) > $OUT/torchrun.log 2>&1
    rc=$?; [ $rc -ne 0 ] && status=1
    echo "== torchrun 2 processes x graphrun train --gpus $tg rc=$rc"; grep -vE "^\s*$" $OUT/torchrun.log | tail -n 4
    python3 -c "
from safetensors.numpy import load_file as l
import numpy as np
a, b = l('/tmp/one.safetensors'), l('/tmp/many.safetensors')
print('largest relative difference, 1 process vs 2:', max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(a[k]), 1e-30)) for k in a))
" 2>&1 | tail -n 1
fi
if [[ $what == *tune* ]]; then
    # Gradient bucket size and NCCL's share of the SMs, on the most GPUs of GPUS.
    for cfg in ${TUNE_CFGS:-dp_stream_priority=0 dp_bucket_bytes=2097152 dp_bucket_bytes=8388608 dp_bucket_bytes=16777216}; do
        (cd /work/main && timeout 100 $G bench models/gpt_block.yaml --backend cuda --dtype bf16 \
            --backward --gpus ${GPUS##* } --iters 30 --warmup 5 --tune $cfg) > /tmp/tune.log 2>&1
        echo "tune $cfg: $(grep -E "median" /tmp/tune.log)"
    done
fi
if [[ $what == *ddp* ]]; then
    for n in $GPUS; do
        PYTHONUNBUFFERED=1 TORCH_REFERENCE_DIR=$C timeout 200 torchrun --standalone --nproc_per_node=$n \
            $C/ddp_reference.py --dtype bf16 --iters 100 --warmup 20 --json $OUT/ddp_gpus$n.json > /tmp/ddp_$n.log 2>&1
        echo "== torch DDP gpt_block bf16 x$n (rc=$?)"; grep -E "DDP|Error|error" /tmp/ddp_$n.log | head -n 4
    done
fi
exit $status
