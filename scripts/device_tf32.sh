#!/usr/bin/env bash
# One device call for f32/tf32 attention on tensor cores (cuda/flash_tf32.cu): the
# attention/grad CUDA tests (GRAPHRUN_REQUIRE_CUDA=1; tests/cuda_3xtf32.rs runs f32 on the
# 3xTF32 kernels), then `graphrun bench` of attention (and gpt_block) — tf32 (one TF32 pass),
# f32 (default: 3xTF32), f32 forced onto 3xTF32 and onto CUDA cores fs_* (=simt) — with this
# tree's graphrun and, where the carry has one (base.tgz), an earlier graphrun side by side
# in the same call. Carried by `TESTS="cuda cuda_3xtf32 cuda_f32_simt ops_attention
# ops_attention_grad grad" scripts/carry_attn.sh ../main/.carry-tf32 device_tf32.sh`
# ([BASE=DIR]); run from the repository root as
#   bash .carry-tf32/device_tf32.sh      (C=.carry-NAME to name another carry folder)
set -u
C=$PWD/${C:-.carry-tf32}
OUT=${OUT:-/tmp/out}
R=/tmp/res
mkdir -p "$OUT" "$R" /tmp/x /tmp/base /tmp/kcache
tar xzf "$C/bin.tgz" -C /tmp/x
[ -f "$C/base.tgz" ] && tar xzf "$C/base.tgz" -C /tmp/base
cp "$C"/kcache/*.cubin /tmp/kcache/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=/tmp/kcache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
bench() {  # name graphrun workload dtype pass [KEY=VALUE of --tune]
    local flag=; [ "$5" = train ] && flag=--backward
    timeout 60 $2 bench models/$3.yaml --backend cuda --dtype $4 $flag ${6:+--tune $6} --iters 30 --warmup 5 \
        --json $R/$1.json > $R/bench_$1.log 2>&1
    echo "bench $1 rc=$?"
}
# the forward first (the question of this call), then the rest
for p in fwd train; do
    bench attention_tf32_$p /tmp/x/graphrun attention tf32 $p
    [ -x /tmp/base/graphrun ] && bench base_attention_tf32_$p /tmp/base/graphrun attention tf32 $p
done
ls /tmp/x/tests/* | xargs -P 4 -I{} bash -c '
    n=$(basename {})
    timeout 150 {} --test-threads=4 --nocapture > '"$R"'/test_$n.log 2>&1; rc=$?
    echo "== $n rc=$rc $(grep -E "^test result" '"$R"'/test_$n.log | tail -n 1)"
    grep -E "^test .* FAILED$|panicked at" -A4 '"$R"'/test_$n.log | head -n 30'
grep -h "^test result" $R/test_*.log | awk '{p+=$4; f+=$6} END {print "TESTS: " p " passed, " f " failed"}'
grep -h -E "rel err|max err|tf32" $R/test_cuda_3xtf32.log | head -n 12
for p in fwd train; do
    bench attention_f32_$p /tmp/x/graphrun attention f32 $p
    bench attention_f32_${p}_3xtf32 /tmp/x/graphrun attention f32 $p cuda_attention_f32=3xtf32
    bench attention_f32_${p}_simt /tmp/x/graphrun attention f32 $p cuda_attention_f32=simt
    bench gpt_block_f32_$p /tmp/x/graphrun gpt_block f32 $p
    bench gpt_block_f32_${p}_simt /tmp/x/graphrun gpt_block f32 $p cuda_attention_f32=simt
    bench gpt_block_tf32_$p /tmp/x/graphrun gpt_block tf32 $p
done
python3 - "$R" <<'PY'
import json, glob, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        r = json.load(open(f))["results"][0]
        print(f"{os.path.basename(f)[:-5]:32s} {r['ms']:.3f} ms  (min {r['ms_min']:.3f})  {r.get('tflops', 0):.1f} TFLOP/s  {r['status']}")
    except Exception as e:
        print(os.path.basename(f), "?", e)
PY
for f in $R/bench_*.log; do grep -q -i "error\|panic" $f && { echo "== $f"; tail -n 5 $f; }; done
tar czf "$OUT/results.tgz" -C $R .
