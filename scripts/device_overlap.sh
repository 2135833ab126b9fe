#!/usr/bin/env bash
# Overlap experiments for data-parallel training (run after scripts/carry_nccl.sh, on a
# 4-GPU device call, carry [".carry-nccl"]): gpt_block bf16 training steps on N GPUs with
# gradient buckets of several sizes and NCCL limited to fewer CTAs (so that the averages
# issued during the backward pass take fewer SMs from it). Each row is
# "ENV=VALUE ... key=value" (NCCL variables, then graphrun --tune settings).
#   [N=4] [ROWS="..."] bash .carry-nccl/device_overlap.sh
C=$(cd "$(dirname "$0")" && pwd)
bash "$C/device_nccl.sh" none > /dev/null 2>&1   # unpacks graphrun and the kernels
export NCCL_NVLS_ENABLE=0 GRAPHRUN_CUDA_CACHE=/tmp/kcache
G=/tmp/x/graphrun
N=${N:-4}
ROWS=${ROWS:-"dp_bucket_bytes=67108864;dp_bucket_bytes=16777216;NCCL_MAX_CTAS=8 dp_bucket_bytes=16777216;NCCL_MAX_CTAS=4 dp_bucket_bytes=16777216;NCCL_MAX_CTAS=4 dp_bucket_bytes=8388608;NCCL_MAX_CTAS=2 dp_bucket_bytes=8388608;NCCL_MAX_CTAS=8 dp_bucket_bytes=67108864"}
IFS=';' read -ra rows <<< "$ROWS"
for row in "${rows[@]}"; do
    envs=(); tunes=()
    for w in $row; do
        if [[ $w == NCCL_* ]]; then envs+=("$w"); else tunes+=(--tune "$w"); fi
    done
    (cd /work/main && env "${envs[@]}" timeout 100 $G bench models/gpt_block.yaml --backend cuda \
        --dtype bf16 --backward --gpus $N --iters 30 --warmup 5 "${tunes[@]}") > /tmp/ov.log 2>&1
    echo "$row: $(grep -E "median" /tmp/ov.log || tail -n 2 /tmp/ov.log)"
done
