#!/usr/bin/env bash
# One device call (the `run` tool) for the CUDA backend: the whole test suite, then
# `graphrun bench --json` for the four workloads × {f32, tf32, bf16} × {fwd, train}, then
# PyTorch's reference rows (torch_reference.py, cudagraph mode; eager for attention) and
# the merged table. Build here and fill the carry folder first (scripts/carry_cuda.sh);
# run on the device from the repository root as
#   bash .carry-cuda/device_cuda.sh [tests|bench|torch ...]   (default: all three)
# (the carry folder is the one this script lies in).
# Everything it writes comes back as $OUT/results.tgz; the table is printed last.
set -u
C=$(cd "$(dirname "$0")" && pwd)
# The checkout and target folder the executables were built in (carry_cuda.sh records them).
ROOT=/work/main TARGET=/work/main/target
[ -f "$C/paths.env" ] && . "$C/paths.env"
OUT=${OUT:-/tmp/out}
R=/tmp/res
# A machine still warm from an earlier call keeps /tmp: start from empty folders.
rm -rf "$R" /tmp/x
mkdir -p "$OUT" "$R" /tmp/x
if [ -f "$C/bin.txz" ]; then
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/bin.txz" /tmp/x
else
    tar xzf "$C/bin.tgz" -C /tmp/x
fi
# The test executables carry the absolute path of the checkout they were built in
# ($ROOT: CARGO_MANIFEST_DIR, and $TARGET for CARGO_BIN_EXE_graphrun) for models/,
# tests/data/ and the graphrun binary: point that path at this checkout (the device's copy
# of the repository).
for d in /work/main "$ROOT"; do
    [ -e "$d" ] || { mkdir -p "$(dirname "$d")" && ln -s "$PWD" "$d"; }
done
mkdir -p "$TARGET/release" && cp /tmp/x/graphrun "$TARGET/release/graphrun"
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=/tmp/kcache
mkdir -p /tmp/kcache && cp "$C"/kcache/*.cubin /tmp/kcache/ 2>/dev/null
G=/tmp/x/graphrun
what=${*:-tests bench torch}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
t0=$(date +%s.%N)
$G doctor 2>&1 | grep -iE "cuda|nvrtc|device" | head -n 6
echo "device opened in $(python3 -c "import time; print(round(time.time() - $t0, 1))") s (kernel families compile on first use, cached on disk)"
status=0
# The Vulkan loader, where carried (gl/): the WebGPU tests and benches then run on the
# same GPU, and CI=1 makes a missing adapter a failure instead of a skip.
if [ -d "$C/gl" ]; then
    for f in "$C"/gl/*.deb; do dpkg -x "$f" /; done; ldconfig
    ICD=$(find /usr/local/nvidia /usr/share/vulkan /etc/vulkan -name "nvidia_icd*.json" 2>/dev/null | head -1)
    [ -n "$ICD" ] && export VK_DRIVER_FILES=$ICD
    export CI=1
    $G doctor 2>&1 | grep -A2 "^wgpu" | grep -v XDG
fi
if [[ $what == *tests* ]]; then
    ls /tmp/x/tests/* | xargs -P 3 -I{} bash -c '
        n=$(basename {}); cd '"$ROOT"'
        timeout 300 {} --test-threads=6 > '"$R"'/test_$n.log 2>&1; rc=$?
        echo "== $n rc=$rc $(grep -E "^test result" '"$R"'/test_$n.log | tail -n 1)"
        grep -E "^test .* FAILED$|panicked at" -A3 '"$R"'/test_$n.log | head -n 20'
    grep -h "^test result" $R/test_*.log | awk '{p+=$4; f+=$6} END {print "TESTS: " p " passed, " f " failed"}'
fi
if [[ $what == *bench* ]]; then
    mkdir -p $R/graphrun
    for w in ${WORKLOADS:-mlp mlp_large gpt_block attention}; do
        for dt in ${DTYPES:-f32 tf32 bf16}; do
            for p in fwd train; do
                flag=; [ $p = train ] && flag=--backward
                (cd "$ROOT" && timeout 90 $G bench models/$w.yaml --backend cuda --dtype $dt $flag \
                    --iters 30 --warmup 5 --json $R/graphrun/${w}_${dt}_$p.json) > $R/bench_${w}_${dt}_$p.log 2>&1
                echo "bench $w $dt $p: $(grep -m1 median $R/bench_${w}_${dt}_$p.log || tail -n 2 $R/bench_${w}_${dt}_$p.log)"
            done
        done
    done
fi
if [[ $what == *torch* ]]; then
    cd $C
    PYTHONUNBUFFERED=1 timeout 400 python3 torch_reference.py --workload all --dtype ${TORCH_DTYPES:-f32,tf32,bf16} --pass fwd,train \
        --mode cudagraph --no-check --target-seconds 0.3 --json $R/torch_cudagraph.json > $R/torch_cudagraph.log 2>&1
    echo "torch cudagraph rc=$?"
    PYTHONUNBUFFERED=1 timeout 120 python3 torch_reference.py --workload attention,mlp_small --dtype f32,bf16 --pass fwd,train \
        --mode eager --no-check --target-seconds 0.3 --json $R/torch_eager.json > $R/torch_eager.log 2>&1
    echo "torch eager rc=$?"
    python3 $C/bench_table.py $R/table.md $R/graphrun/*.json $R/torch_*.json
fi
if [[ $what == *ncu* ]]; then
    # Kernel durations of bf16 training steps (Nsight Compute, clocks left alone): the per-node
    # profile `bench` prints synchronises every node; this is what the GPU itself spends.
    # Launches 200-499 are past the first (eager) steps; the heuristic's GEMM algorithms
    # are kept (no timing runs among the launches).
    for w in ${NCU_WORKLOADS:-gpt_block mlp_large}; do
        (cd "$ROOT" && timeout 300 ncu --clock-control none --csv \
            --metrics gpu__time_duration.sum --launch-skip 200 --launch-count 300 \
            $G bench models/$w.yaml --backend cuda --dtype bf16 --backward --iters 2 --warmup 2 \
            --tune cublaslt_tune=1) \
            > $R/ncu_$w.csv 2> $R/ncu_$w.err
        echo "ncu $w rc=$?"
        python3 - $R/ncu_$w.csv <<'PY' | tee $R/ncu_$w.md
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; rows = rows[1:]
k, u, v = h.index("Kernel Name"), h.index("Metric Unit"), h.index("Metric Value")
tot, n = collections.defaultdict(float), collections.Counter()
for r in rows:
    x = float(r[v].replace(",", "")) * {"nsecond": 1e-3, "usecond": 1, "msecond": 1e3}.get(r[u], 1)
    name = r[k].split("(")[0][:60]; tot[name] += x; n[name] += 1
print(f"| kernel | launches | mean us | share |  (over {len(rows)} launches)")
print("|---|---|---|---|")
all_ = sum(tot.values())
for name in sorted(tot, key=lambda m: -tot[m]):
    print(f"| {name} | {n[name]} | {tot[name] / n[name]:.1f} | {100 * tot[name] / all_:.1f}% |")
PY
    done
fi
if [[ $what == *wgpu* ]]; then
    # The WebGPU backend beside CUDA (f32 and f16) for the four workloads: issue 6's table.
    mkdir -p $R/wgpu
    for w in mlp mlp_large gpt_block attention; do
        for dt in f32 f16; do
            for p in fwd train; do
                flag=; [ $p = train ] && flag=--backward
                for be in wgpu cuda; do
                    [ $be = cuda ] && [ $dt = f32 ] && [ -e $R/graphrun/${w}_f32_$p.json ] && continue
                    (cd "$ROOT" && timeout 120 $G bench models/$w.yaml --backend $be --dtype $dt $flag \
                        --iters 10 --warmup 2 --json $R/wgpu/${be}_${w}_${dt}_$p.json) > $R/wgpu_${be}_${w}_${dt}_$p.log 2>&1
                    echo "bench $be $w $dt $p: $(grep -m1 median $R/wgpu_${be}_${w}_${dt}_$p.log || tail -n 2 $R/wgpu_${be}_${w}_${dt}_$p.log)"
                done
            done
        done
    done
    python3 - "$R" <<'PY' | tee $R/wgpu_table.md
import json, glob, os, sys
R = sys.argv[1]
def ms(path):
    try: return json.load(open(path))["results"][0]["ms"]
    except Exception: return None
torch = {}
for f in glob.glob(os.path.join(R, "torch_cudagraph.json")):
    for r in json.load(open(f)).get("results", []):
        if r.get("status", "ok") == "ok": torch[(r["workload"], r["dtype"], r["pass"])] = r["ms"]
name = {"mlp": "mlp_small"}
f = lambda v: "-" if v is None else f"{v:.3f}"
print("| workload | pass | wgpu f32 ms | cuda f32 ms | PyTorch f32 ms (cudagraph) | wgpu f16 ms | cuda f16 ms |")
print("|---|---|---|---|---|---|---|")
for w in ["mlp", "mlp_large", "gpt_block", "attention"]:
    for p in ["fwd", "train"]:
        cf32 = ms(f"{R}/wgpu/cuda_{w}_f32_{p}.json") or ms(f"{R}/graphrun/{w}_f32_{p}.json")
        print(f"| {name.get(w, w)} | {p} | {f(ms(f'{R}/wgpu/wgpu_{w}_f32_{p}.json'))} | {f(cf32)} | "
              f"{f(torch.get((name.get(w, w), 'f32', p)))} | {f(ms(f'{R}/wgpu/wgpu_{w}_f16_{p}.json'))} | "
              f"{f(ms(f'{R}/wgpu/cuda_{w}_f16_{p}.json'))} |")
PY
fi
tar czf "$OUT/results.tgz" -C $R .
exit $status
