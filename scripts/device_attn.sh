#!/usr/bin/env bash
# One device call for the attention kernels (issue 5): the attention/grad CUDA tests, then
# `graphrun bench` for attention and gpt_block in bf16/f32, fwd/train (and bf16 attention on
# the mma.sync kernels, --tune cuda_attention=mma, to compare; MODES: more such choices
# for bf16 attention and gpt_block, TEST_MODES: the choices the tests run under besides the
# default). Carried by scripts/carry_attn.sh; run from the repository root as
#   [DTYPES="bf16"] [MODES="px2"] [TEST_MODES="mma px2"] bash .carry-attn/device_attn.sh
# (the carry folder is the one this script lies in).
set -u
C=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
# Folders of our own, emptied first: a machine still warm from another call keeps its /tmp
# (executables and results of other scripts were picked up from /tmp/x and /tmp/res).
X=/tmp/attn_x KC=/tmp/attn_kcache R=/tmp/attn_res
rm -rf "$X" "$KC" "$R"
mkdir -p "$OUT" "$R" "$X" "$KC"
tar xzf "$C/bin.tgz" -C "$X"
cp "$C"/kcache/*.cubin "$KC"/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=$KC
G=$X/graphrun
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
t0=$(date +%s.%N)
$G doctor 2>&1 | grep -iE "cuda|nvrtc" | head -n 4
echo "kernels ready in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s; cache: $(ls "$KC")"
ls "$X"/tests/* | xargs -P 4 -I{} bash -c '
    n=$(basename {})
    timeout 240 {} --test-threads=4 > '"$R"'/test_$n.log 2>&1; rc=$?
    echo "== $n rc=$rc $(grep -E "^test result" '"$R"'/test_$n.log | tail -n 1)"
    grep -E "^test .* FAILED$|panicked at" -A4 '"$R"'/test_$n.log | head -n 30'
grep -h "^test result" $R/test_*.log | awk '{p+=$4; f+=$6} END {print "TESTS: " p " passed, " f " failed"}'
# The mma.sync kernels (cuda_attention=mma) and the other choices through the attention
# tests too (GRAPHRUN_TUNE: the test harness's --tune, tests/common/mod.rs).
for mode in ${TEST_MODES:-mma}; do
    for n in cuda ops_attention ops_attention_grad grad; do
        GRAPHRUN_TUNE=cuda_attention=$mode timeout 120 $X/tests/$n --test-threads=4 > $R/test_${mode}_$n.log 2>&1
        echo "== $mode $n rc=$? $(grep -E "^test result" $R/test_${mode}_$n.log | tail -n 1)"
        grep -E "^test .* FAILED$|panicked at" -A4 $R/test_${mode}_$n.log | head -n 20
    done
done
bench() {  # name workload dtype pass [KEY=VALUE of --tune]
    local flag=; [ "$4" = train ] && flag=--backward
    timeout 90 $G bench models/$2.yaml --backend cuda --dtype $3 $flag ${5:+--tune $5} --iters 30 --warmup 5 \
        --json $R/$1.json > $R/bench_$1.log 2>&1
    echo "bench $1: $(grep -m1 -E 'median|ms' $R/bench_$1.log | head -c 200)"
    grep -E "^\s+\S+\s+(Attention|AttentionGrad)\s" $R/bench_$1.log | head -n 2
}
for w in attention gpt_block; do
    for dt in ${DTYPES:-bf16 f32}; do
        for p in fwd train; do bench ${w}_${dt}_$p $w $dt $p; done
    done
done
for p in fwd train; do bench attention_bf16_${p}_mma attention bf16 $p cuda_attention=mma; done
for mode in ${MODES:-}; do
    for w in attention gpt_block; do
        for p in fwd train; do bench ${w}_bf16_${p}_$mode $w bf16 $p cuda_attention=$mode; done
    done
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
cuobjdump -sass "$KC"/*.cubin 2>/dev/null | grep -oE "HGMMA[.A-Z0-9x]*" | sort | uniq -c | head -5
tar czf "$OUT/results.tgz" -C $R .
