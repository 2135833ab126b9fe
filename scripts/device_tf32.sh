#!/usr/bin/env bash
# One device call for f32 attention on tensor cores (issue 5, cuda/flash_tf32.cu): the
# attention/grad CUDA tests (tests/cuda_3xtf32.rs: f32 on the 3xTF32 kernels), then
# `graphrun bench` for attention and gpt_block in f32 (CUDA cores) / tf32 (one TF32 pass),
# fwd/train, and f32 once more on the 3xTF32 kernels (GRAPHRUN_CUDA_ATTENTION_F32=3xtf32)
# to compare in the same call. Carried by
# scripts/carry_tf32.sh; run from the repository root as  bash .carry-tf32/device_tf32.sh
set -u
C=$PWD/.carry-tf32
OUT=${OUT:-/tmp/out}
R=/tmp/res
mkdir -p "$OUT" "$R" /tmp/x /tmp/kcache
tar xzf "$C/bin.tgz" -C /tmp/x
cp "$C"/kcache/*.cubin /tmp/kcache/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=/tmp/kcache
G=/tmp/x/graphrun
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
ls /tmp/x/tests/* | xargs -P 4 -I{} bash -c '
    n=$(basename {})
    timeout 240 {} --test-threads=4 > '"$R"'/test_$n.log 2>&1; rc=$?
    echo "== $n rc=$rc $(grep -E "^test result" '"$R"'/test_$n.log | tail -n 1)"
    grep -E "^test .* FAILED$|panicked at" -A4 '"$R"'/test_$n.log | head -n 30'
grep -h "^test result" $R/test_*.log | awk '{p+=$4; f+=$6} END {print "TESTS: " p " passed, " f " failed"}'
/tmp/x/tests/cuda_3xtf32 --nocapture 2>&1 | grep -E "rel err" | head -n 10
bench() {  # name workload dtype pass [env]
    local flag=; [ "$4" = train ] && flag=--backward
    env ${5:-} timeout 90 $G bench models/$2.yaml --backend cuda --dtype $3 $flag --iters 30 --warmup 5 \
        --json $R/$1.json > $R/bench_$1.log 2>&1
    echo "bench $1: $(grep -m1 -E 'median|ms' $R/bench_$1.log | head -c 200)"
    grep -E "^\s+\S+\s+(Attention|AttentionGrad)\s" $R/bench_$1.log | head -n 2
}
for w in attention gpt_block; do
    for dt in f32 tf32; do
        for p in fwd train; do bench ${w}_${dt}_$p $w $dt $p; done
    done
done
for w in attention gpt_block; do
    for p in fwd train; do bench ${w}_f32_${p}_3xtf32 $w f32 $p GRAPHRUN_CUDA_ATTENTION_F32=3xtf32; done
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
tar czf "$OUT/results.tgz" -C $R .
