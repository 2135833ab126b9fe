#!/usr/bin/env bash
# One device call comparing this build's attention kernels with an earlier one (BASE= of
# scripts/carry_attn.sh) and with `--tune cuda_attention=MODE` modes: the tests (this build)
# under TEST_MODES ("default" = none; other modes, through the test harness's GRAPHRUN_TUNE,
# run only TESTS2), then `graphrun bench` medians
# of ROWS (workload:dtype:pass) for this build (default and each of MODES) and the base, REPS
# rounds interleaved, then (NCU=1) attention kernel times of one bf16 training step.
# TEST_TIMEOUT, BENCH_TIMEOUT, NCU_TIMEOUT bound each step (a hang costs device time).
# Carried by
#   TESTS="cuda ops_attention ops_attention_grad grad" BASE=DIR scripts/carry_attn.sh DEST device_ab.sh
# and run (carry [DEST]) as  [NAME=main] [TEST_MODES="default bpq"] [MODES="bpq"] [REPS=2]
#   [NCU=1] [SKIP_TESTS=1] [ROWS="attention:bf16:train ..."] bash DEST/device_ab.sh
# (NAME: the worktree /work/NAME or /work/wt-NAME the test executables were built in.)
set -u
C=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
X=/tmp/ab_x KC=/tmp/ab_kcache R=$OUT/ab
rm -rf "$X" "$KC" && mkdir -p "$R" "$X/base" "$KC"
tar xzf "$C/bin.tgz" -C "$X"
[ -f "$C/base.tgz" ] && tar xzf "$C/base.tgz" -C "$X/base"
cp "$C"/kcache/*.cubin "$KC"/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=$KC
# The tests read the tree they were built in (CARGO_MANIFEST_DIR, CARGO_BIN_EXE_graphrun).
NAME=${NAME:-main}
W=/work/$NAME; [ $NAME = main ] || W=/work/wt-$NAME
T=/work/main/target; [ $NAME = main ] || T=/work/target-$NAME
mkdir -p /work && { [ -e $W ] || ln -s "$PWD" $W; }
mkdir -p $T/release && cp $X/graphrun $T/release/graphrun 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
    for mode in ${TEST_MODES:-default}; do
        if [ $mode = default ]; then unset GRAPHRUN_TUNE; TL=$(ls $X/tests); else export GRAPHRUN_TUNE=cuda_attention=$mode; TL=${TESTS2:-cuda ops_attention_grad grad}; fi
        for n in $TL; do
            t=$X/tests/$n
            timeout ${TEST_TIMEOUT:-200} $t --test-threads=4 > $R/test_${mode}_$n.log 2>&1
            rc=$?
            echo "== $mode $n rc=$rc $(grep -E '^test result' $R/test_${mode}_$n.log | tail -n 1)"
            # (a mode whose tests fail or hang is not benched)
            if [ $rc != 0 ]; then MODES=$(echo " ${MODES:-} " | sed "s/ ${mode%2} / /g; s/ $mode / /g"); echo "dropped $mode from MODES: '$MODES'"; fi
            grep -E "^test .* FAILED$|panicked at" -A4 $R/test_${mode}_$n.log | head -n 20
        done
        grep -h "^test result" $R/test_${mode}_*.log | awk -v m=$mode '{p+=$4; f+=$6; i+=$8} END {print "TESTS " m ": " p " passed, " f " failed, " i " ignored"}'
    done
    unset GRAPHRUN_TUNE
fi
ROWS=${ROWS:-attention:bf16:train attention:f16:train gpt_block:bf16:train}
for rep in $(seq 1 ${REPS:-2}); do
    for row in $ROWS; do
        IFS=: read w d p <<< "$row"
        flag=; [ $p = train ] && flag=--backward
        for b in new base ${MODES:-}; do
            G=$X/graphrun; [ $b = base ] && G=$X/base/graphrun
            [ -x $G ] || continue
            tune=; case $b in new|base) ;; *) tune="--tune cuda_attention=$b";; esac
            timeout ${BENCH_TIMEOUT:-60} $G bench models/$w.yaml --backend cuda --dtype $d $flag $tune --iters 30 --warmup 5 --json $R/${w}_${d}_${p}_${b}_$rep.json > /dev/null 2>&1
        done
    done
done
python3 - "$R" ${MODES:-} <<'PY'
import json, glob, os, sys, collections
t = collections.defaultdict(list)
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    k = os.path.basename(f)[:-5].rsplit("_", 2)
    try: t[(k[0], k[1])].append(json.load(open(f))["results"][0]["ms"])
    except Exception as e: t[(k[0], k[1])].append(float("nan"))
for row in sorted({r for r, _ in t}):
    print(f"{row:24s} " + "   ".join(f"{m} {' '.join(f'{x:.3f}' for x in t[(row, m)])}" for m in ["new", "base"] + sys.argv[2:]))
PY
if [ -n "${NCU:-}" ]; then
    for b in new base ${MODES:-}; do
        G=$X/graphrun; [ $b = base ] && G=$X/base/graphrun
        [ -x $G ] || continue
        tune=; case $b in new|base) ;; *) tune="--tune cuda_attention=$b";; esac
        timeout ${NCU_TIMEOUT:-90} ncu --clock-control none -k regex:"fa_" -c 8 --metrics gpu__time_duration.sum \
            $G bench models/attention.yaml --backend cuda --dtype bf16 --backward $tune --iters 1 --warmup 0 > $R/ncu_$b.log 2>&1
        echo "ncu $b:"; grep -E "^  fa_|gpu__time_duration" $R/ncu_$b.log | paste - - | awk '{print $1, $(NF)}' | head -n 8
    done
fi
