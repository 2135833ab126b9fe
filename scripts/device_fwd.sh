#!/usr/bin/env bash
# One device call for the warp-specialized attention forward (fa_fwd_ws, session 5): the
# attention tests (default kernels, then each of TEST_MODES as GRAPHRUN_CUDA_ATTENTION),
# then `graphrun bench` medians for attention bf16 fwd/train, f16 fwd and gpt_block bf16
# fwd under the default and each of MODES (`wg`: the one-warpgroup kernel as before, `mma`;
# src/backends/cuda/attention.rs; training only for TRAIN_MODES). Carried by
# `scripts/carry_attn.sh ../main/.carry-fwd device_fwd.sh` (TESTS="cuda ops_attention ops_attention_grad"); run as
#   [MODES="wg mma"] [TEST_MODES="wg"] [TRAIN_MODES="default wg"] [NCU="default"] [REPS=1] \
#   [NAME=fwd] bash .carry-fwd/device_fwd.sh
# (NAME: the worktree /work/wt-NAME and target folder /work/target-NAME it was built in;
# REPS: rounds of the benches, interleaved, results suffixed _rN from the second on.)
set -u
C=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
X=/tmp/fwd_x KC=/tmp/fwd_kcache R=/tmp/fwd_res
rm -rf "$X" "$KC" "$R"
mkdir -p "$OUT" "$R" "$X" "$KC"
tar xzf "$C/bin.tgz" -C "$X"
cp "$C"/kcache/*.cubin "$KC"/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=$KC
# The tests read the tree they were built in (CARGO_MANIFEST_DIR, and CARGO_BIN_EXE_graphrun
# under the target folder): point it at this checkout.
NAME=${NAME:-fwd}
mkdir -p /work && { [ -e /work/wt-$NAME ] || ln -s "$PWD" /work/wt-$NAME; }
mkdir -p /work/target-$NAME/release && cp $X/graphrun /work/target-$NAME/release/graphrun
G=$X/graphrun
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
HUNG=
for mode in default ${TEST_MODES:-wg}; do
    env=; [ $mode != default ] && env=GRAPHRUN_CUDA_ATTENTION=$mode
    for n in ops_attention cuda ops_attention_grad; do
        case " $HUNG " in *" $mode "*) continue;; esac
        tl=150; [ $mode != default ] && tl=60
        env $env timeout $tl $X/tests/$n --test-threads=4 > $R/test_${mode}_$n.log 2>&1
        rc=$?
        echo "== $mode $n rc=$rc $(grep -E "^test result" $R/test_${mode}_$n.log | tail -n 1)"
        grep -E "^test .* FAILED$|panicked at" -A4 $R/test_${mode}_$n.log | head -n 20
        [ $rc = 124 ] && HUNG="$HUNG $mode"
    done
done
grep -h "^test result" $R/test_default_*.log | awk '{p+=$4; f+=$6} END {print "DEFAULT TESTS: " p " passed, " f " failed"}'
bench() {  # name workload dtype pass [env]
    local flag=; [ "$4" = train ] && flag=--backward
    env ${5:-} timeout 60 $G bench models/$2.yaml --backend cuda --dtype $3 $flag --iters 30 --warmup 5 \
        --json $R/$1.json > $R/bench_$1.log 2>&1
    echo "bench $1 rc=$?: $(grep -m1 -E 'median|ms' $R/bench_$1.log | head -c 200)"
}
for rep in $(seq 1 ${REPS:-1}); do
sf=; [ $rep != 1 ] && sf=_r$rep
for mode in default ${MODES:-wg}; do
    case " $HUNG " in *" $mode "*) echo "skip benches of $mode (tests hung)"; continue;; esac
    env=; [ $mode != default ] && env=GRAPHRUN_CUDA_ATTENTION=$mode
    bench attention_bf16_fwd_$mode$sf attention bf16 fwd $env
    case " ${TRAIN_MODES:-default wg} " in *" $mode "*) bench attention_bf16_train_$mode$sf attention bf16 train $env;; esac
    bench attention_f16_fwd_$mode$sf attention f16 fwd $env
    bench gpt_block_bf16_fwd_$mode$sf gpt_block bf16 fwd $env
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
# NCU="default wg": one profiled launch of the forward kernel under each of these modes.
for mode in ${NCU:-}; do
    case " $HUNG " in *" $mode "*) continue;; esac
    command -v ncu > /dev/null || break
    env=; [ $mode != default ] && env=GRAPHRUN_CUDA_ATTENTION=$mode
    env $env timeout 120 ncu --clock-control none -k regex:fa_fwd -c 1 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --metrics smsp__inst_executed.sum \
        $G bench models/attention.yaml --backend cuda --dtype bf16 --iters 1 --warmup 0 > $R/ncu_$mode.log 2>&1
    echo "ncu $mode:"; grep -E "  fa_fwd|Duration|SM Active|Throughput|No Eligible|Active Warps|Issued Warp|inst_executed|hmma|stalled" $R/ncu_$mode.log | head -n 20
done
tar czf "$OUT/results.tgz" -C $R .
