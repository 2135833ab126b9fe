#!/usr/bin/env bash
# One device call for the warp-specialized attention backward (fa_bwd_ws, session 5): the
# attention and gradient tests (default kernels, then each of TEST_MODES as
# GRAPHRUN_CUDA_ATTENTION), then `graphrun bench` medians of attention and gpt_block bf16
# training under the default and each of MODES (`bwd1`: the one-warpgroup one pass,
# fa_bwd_wg), REPS rounds interleaved, then (NCU=1) the backward kernels' times under ncu.
# Carried by `scripts/carry_attn.sh ../main/.carry-bws device_bws.sh`; run as
#   [MODES="bwd1"] [TEST_MODES="bwd1"] [REPS=2] [NCU=1] bash .carry-bws/device_bws.sh
set -u
C=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
X=/tmp/bws_x KC=/tmp/bws_kcache R=/tmp/bws_res
rm -rf "$X" "$KC" "$R"
mkdir -p "$OUT" "$R" "$X" "$KC"
tar xzf "$C/bin.tgz" -C "$X"
cp "$C"/kcache/*.cubin "$KC"/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=$KC
# The tests read the tree they were built in (CARGO_MANIFEST_DIR, and CARGO_BIN_EXE_graphrun
# under the target folder): point it at this checkout.
mkdir -p /work && { [ -e /work/wt-bws ] || ln -s "$PWD" /work/wt-bws; }
mkdir -p /work/target-bws/release && cp $X/graphrun /work/target-bws/release/graphrun
G=$X/graphrun
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
HUNG=
for mode in default ${TEST_MODES:-}; do
    env=; [ $mode != default ] && env=GRAPHRUN_CUDA_ATTENTION=$mode
    for n in ops_attention ops_attention_grad grad cuda; do
        case " $HUNG " in *" $mode "*) continue;; esac
        env $env timeout 120 $X/tests/$n --test-threads=4 > $R/test_${mode}_$n.log 2>&1
        rc=$?
        echo "== $mode $n rc=$rc $(grep -E "^test result" $R/test_${mode}_$n.log | tail -n 1)"
        grep -E "^test .* FAILED$|panicked at" -A4 $R/test_${mode}_$n.log | head -n 20
        [ $rc = 124 ] && HUNG="$HUNG $mode"
    done
done
grep -h "^test result" $R/test_default_*.log | awk '{p+=$4; f+=$6; i+=$8} END {print "DEFAULT TESTS: " p " passed, " f " failed, " i " ignored"}'
bench() {  # name workload dtype pass [env]
    local flag=; [ "$4" = train ] && flag=--backward
    env ${5:-} timeout 60 $G bench models/$2.yaml --backend cuda --dtype $3 $flag --iters 30 --warmup 5 \
        --json $R/$1.json > $R/bench_$1.log 2>&1
    echo "bench $1 rc=$?"
}
for rep in $(seq 1 ${REPS:-2}); do
    for mode in default ${MODES:-bwd1}; do
        case " $HUNG " in *" $mode "*) echo "skip benches of $mode (tests hung)"; continue;; esac
        env=; [ $mode != default ] && env=GRAPHRUN_CUDA_ATTENTION=$mode
        bench attention_bf16_train_${mode}_$rep attention bf16 train $env
        bench gpt_block_bf16_train_${mode}_$rep gpt_block bf16 train $env
    done
done
python3 - "$R" <<'PY'
import json, glob, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    try:
        r = json.load(open(f))["results"][0]
        print(f"{os.path.basename(f)[:-5]:36s} {r['ms']:.3f} ms  (min {r['ms_min']:.3f})  {r['status']}")
    except Exception as e:
        print(os.path.basename(f), "?", e)
PY
# NCU=1: the backward's kernel times (µs) under the default and each of MODES.
if [ -n "${NCU:-}" ] && command -v ncu > /dev/null; then
    for mode in default ${MODES:-bwd1}; do
        case " $HUNG " in *" $mode "*) continue;; esac
        env=; [ $mode != default ] && env=GRAPHRUN_CUDA_ATTENTION=$mode
        env $env timeout 90 ncu --clock-control none -k regex:"fa_bw|fa_dq_out" -c 6 --metrics gpu__time_duration.sum \
            $G bench models/attention.yaml --backend cuda --dtype bf16 --backward --iters 1 --warmup 0 > $R/ncu_$mode.log 2>&1
        echo "ncu $mode:"; grep -E "^  fa_|gpu__time_duration" $R/ncu_$mode.log | paste - - | awk '{print $1, $(NF)}' | head -n 8
    done
fi
tar czf "$OUT/results.tgz" -C $R .
