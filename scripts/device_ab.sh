#!/usr/bin/env bash
# One device call comparing this build's attention kernels with an earlier one (BASE= of
# scripts/carry_attn.sh): the attention/gradient tests with GRAPHRUN_REQUIRE_CUDA=1 (this
# build), then `graphrun bench` medians of ROWS (workload:dtype:pass) for this build and the
# base, REPS rounds interleaved, then (NCU=1) both builds' attention kernel times of one
# bf16 training step under ncu. Carried by
#   TESTS="cuda ops_attention ops_attention_grad grad" BASE=DIR scripts/carry_attn.sh DEST device_ab.sh
# and run as  [ROWS="attention:bf16:fwd attention:bf16:train:MODE ..."] (MODE: GRAPHRUN_CUDA_ATTENTION) [REPS=2] [NCU=1] [SKIP_TESTS=1] bash DEST/device_ab.sh
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
mkdir -p /work && { [ -e /work/main ] || ln -s "$PWD" /work/main; }
mkdir -p /work/main/target/release && cp $X/graphrun /work/main/target/release/graphrun 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
    for t in $X/tests/*; do
        n=$(basename $t)
        timeout 200 $t --test-threads=4 > $R/test_$n.log 2>&1
        echo "== $n rc=$? $(grep -E '^test result' $R/test_$n.log | tail -n 1)"
        grep -E "^test .* FAILED$|panicked at" -A4 $R/test_$n.log | head -n 20
    done
    grep -h "^test result" $R/test_*.log | awk '{p+=$4; f+=$6; i+=$8} END {print "TESTS: " p " passed, " f " failed, " i " ignored"}'
fi
ROWS=${ROWS:-attention:bf16:fwd attention:bf16:train attention:f16:fwd gpt_block:bf16:fwd gpt_block:bf16:train}
for rep in $(seq 1 ${REPS:-2}); do
    for row in $ROWS; do
        IFS=: read w d p m <<< "$row"
        flag=; [ $p = train ] && flag=--backward
        env=; [ -n "$m" ] && env=GRAPHRUN_CUDA_ATTENTION=$m
        for b in new base; do
            G=$X/graphrun; [ $b = base ] && G=$X/base/graphrun
            [ -x $G ] || continue
            env $env timeout 60 $G bench models/$w.yaml --backend cuda --dtype $d $flag --iters 30 --warmup 5 --json $R/${w}_${d}_${p}${m:+-$m}_${b}_$rep.json > /dev/null 2>&1
        done
    done
done
python3 - "$R" <<'PY'
import json, glob, os, sys, collections
t = collections.defaultdict(list)
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    k = os.path.basename(f)[:-5].rsplit("_", 2)
    try: t[(k[0], k[1])].append(json.load(open(f))["results"][0]["ms"])
    except Exception as e: t[(k[0], k[1])].append(float("nan"))
for row in sorted({r for r, _ in t}):
    print(f"{row:28s} new {' '.join(f'{x:.3f}' for x in t[(row, 'new')])}   base {' '.join(f'{x:.3f}' for x in t[(row, 'base')])}")
PY
if [ -n "${NCU:-}" ]; then
    for b in new base; do
        G=$X/graphrun; [ $b = base ] && G=$X/base/graphrun
        [ -x $G ] || continue
        timeout 90 ncu --clock-control none -k regex:"fa_" -c 8 --metrics gpu__time_duration.sum \
            $G bench models/attention.yaml --backend cuda --dtype bf16 --backward --iters 1 --warmup 0 > $R/ncu_$b.log 2>&1
        echo "ncu $b:"; grep -E "^  fa_|gpu__time_duration" $R/ncu_$b.log | paste - - | awk '{print $1, $(NF)}' | head -n 8
    done
fi
