#!/usr/bin/env bash
# One device call for the operator work: the test executables scripts/carry_ops.sh carried
# (GRAPHRUN_REQUIRE_CUDA=1: none may skip CUDA; ONNX's node suite from the carry), then
# `graphrun bench` of the four workloads in f32 and bf16, forward and training step, for
# this build and the base build, interleaved (REPS rounds), with the medians side by side.
#   [REPS=2] [WORKLOADS=".."] [DTYPES=".."] [PASSES=".."] bash .carry-ops/device_ops.sh [tests] [bench]
# (default: both; the records stay on the device, the table is printed)
set -u
C=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
X=/tmp/ops_x R=$OUT/ops
rm -rf "$X" && mkdir -p "$X" "$R" /tmp/kcache
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/bin.txz" "$X"
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/node.txz" "$X"
# Kernels carried as a folder, or compressed (kcache.txz) where the carry runs short.
[ -f "$C/kcache.txz" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/kcache.txz" /tmp
cp "$C"/kcache/*.cubin /tmp/kcache/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=/tmp/kcache GRAPHRUN_ONNX_NODE_TESTS=$X/node
# The test executables read the checkout they were built in (/work/main).
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
mkdir -p /work/main/target/release && cp $X/graphrun /work/main/target/release/graphrun
mkdir -p /work/main/target/debug && cp $X/graphrun /work/main/target/debug/graphrun
what=${*:-tests bench}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ $what == *tests* ]]; then
    for t in $X/tests/*; do
        n=$(basename $t)
        (cd /work/main && timeout 400 $t --test-threads=4 > $R/test_$n.log 2>&1)
        echo "== $n rc=$? $(grep -E '^test result' $R/test_$n.log | tail -n 1)"
        grep -E "^test .* FAILED$|panicked at" -A4 $R/test_$n.log | head -n 30
    done
    grep -h "^test result" $R/test_*.log | awk '{p+=$4; f+=$6} END {print "TESTS: " p " passed, " f " failed"}'
fi
if [[ $what == *bench* ]]; then
    rm -rf /tmp/ops_bench && mkdir -p /tmp/ops_bench
    for rep in $(seq 1 ${REPS:-2}); do
        for w in ${WORKLOADS:-mlp mlp_large gpt_block attention}; do
            for dt in ${DTYPES:-f32 bf16}; do
                for p in ${PASSES:-fwd train}; do
                    flag=; [ $p = train ] && flag=--backward
                    for b in new base; do
                        g=$X/graphrun; [ $b = base ] && g=$X/graphrun_base
                        (cd /work/main && timeout 90 $g bench models/$w.yaml --backend cuda --dtype $dt $flag \
                            --iters 30 --warmup 5 --json /tmp/ops_bench/${b}_${w}_${dt}_${p}_$rep.json) > /tmp/ops_bench/${b}_${w}_${dt}_${p}_$rep.log 2>&1
                    done
                done
            done
        done
    done
    python3 - /tmp/ops_bench <<'PY'
import json, sys, glob, os, statistics
r = sys.argv[1]
def med(path):
    try:
        j = json.load(open(path))
    except Exception:
        return None
    if isinstance(j, dict) and "results" in j:
        j = j["results"][0] if j["results"] else {}
    return j.get("ms") if isinstance(j, dict) else None
rows = {}
for f in glob.glob(os.path.join(r, "*.json")):
    b, rest = os.path.basename(f).split("_", 1)
    key = rest.rsplit("_", 1)[0]
    m = med(f)
    if m is not None: rows.setdefault(key, {}).setdefault(b, []).append(m)
print("| workload dtype pass | new ms | base ms | new / base | new samples | base samples |")
print("|---|---|---|---|---|---|")
for k in sorted(rows):
    n, b = rows[k].get("new"), rows[k].get("base")
    if n and b:
        mn, mb = statistics.median(n), statistics.median(b)
        f = lambda v: " ".join(f"{x:.3f}" for x in sorted(v))
        print(f"| {k} | {mn:.3f} | {mb:.3f} | {mn / mb:.3f} | {f(n)} | {f(b)} |")
PY
fi
