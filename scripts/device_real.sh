#!/usr/bin/env bash
# One device call for the real-transformer work: the CUDA tests scripts/carry_ops.sh carried
# (GRAPHRUN_REQUIRE_CUDA=1: none may skip CUDA), then models/llama_layer.yaml (one
# LLaMA-style decoder layer: d 2048, 32/8 heads, RMSNorm, rotary, SwiGLU 5632; batch 4 x
# 2048) timed with `graphrun bench` on CUDA in bf16, forward and training step, beside
# PyTorch eager and torch.compile of the same layer from the bench reference script
# (carried as DEST/real_reference.py) in the same call. `ptx`: the shipped compute_80 PTX
# (DEST/ptx.txz, from `scripts/precompile_kernels.py --ship`, its machine code left out)
# put beside graphrun and the test executables with an empty kernel cache, so that every
# family but flash runs from PTX the driver compiles: `doctor`, a cold and a warm first
# run of models/mlp.yaml, and the CUDA tests that way.
# `zoo`: every vendored export of tests/fixtures/zoo measured on CUDA by
# scripts/zoo_status.py (STATUS.cuda.tsv comes back under $OUT/real). WORKLOADS picks the
# bench models (models/<w>.yaml beside the reference's workload of the same name:
# llama_layer, gpt2_124m); TUNES adds a bench row per `--tune KEY=VALUE` it lists.
#   [WORKLOADS="llama_layer gpt2_124m"] [TUNES="k=v ..."] bash DEST/device_real.sh [tests] [bench] [zoo] [ptx]
set -u
C=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
X=/tmp/real_x R=$OUT/real
rm -rf "$X" && mkdir -p "$X" "$R" /tmp/kcache
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/bin.txz" "$X"
[ -f "$C/node.txz" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/node.txz" "$X"
[ -f "$C/kcache.txz" ] && python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/kcache.txz" /tmp
cp "$C"/kcache/*.cubin /tmp/kcache/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=/tmp/kcache GRAPHRUN_ONNX_NODE_TESTS=$X/node
# The test executables read the checkout they were built in (/work/main).
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
mkdir -p /work/main/target/release /work/main/target/debug
cp $X/graphrun /work/main/target/release/graphrun && cp $X/graphrun /work/main/target/debug/graphrun
what=${*:-tests bench}
if [[ $what == *ptx* ]]; then
    ls -la $C/ptx.txz
    for d in $X $X/tests; do
        mkdir -p $d/graphrun-kernels
        python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$C/ptx.txz" $d/graphrun-kernels
    done
    export GRAPHRUN_CUDA_CACHE=/tmp/kcache_empty
    rm -rf /tmp/kcache_empty ~/.nv/ComputeCache
    (cd /work/main && $X/graphrun doctor 2>&1 | grep -E "device 0|PTX|shipped")
    for run in cold warm; do
        s=$(date +%s.%N)
        (cd /work/main && $X/graphrun models/mlp.yaml --backend cuda > /dev/null 2>$R/mlp_$run.err) || head -n 5 $R/mlp_$run.err
        echo "models/mlp.yaml --backend cuda from shipped PTX, $run driver cache: $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s"
    done
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [[ $what == *tests* ]]; then
    for t in $X/tests/*; do
        [ -f $t ] || continue
        n=$(basename $t)
        (cd /work/main && timeout 300 $t --test-threads=4 > $R/test_$n.log 2>&1)
        echo "== $n rc=$? $(grep -E '^test result' $R/test_$n.log | tail -n 1)"
        grep -E "^test .* FAILED$|panicked at" -A4 $R/test_$n.log | head -n 30
    done
    grep -h "^test result" $R/test_*.log | awk '{p+=$4; f+=$6} END {print "TESTS: " p " passed, " f " failed"}'
fi
if [[ $what == *zoo* ]]; then
    # Every vendored export on CUDA: outputs against ONNX Runtime's, gradients against
    # PyTorch's (docs/MODELS.md's CUDA column).
    (cd /work/main && timeout 900 python3 scripts/zoo_status.py --backend cuda --graphrun $X/graphrun > $R/zoo_cuda.log 2>&1)
    echo "zoo on CUDA rc=$?: $(grep -c ': runs / ok' $R/zoo_cuda.log) of $(wc -l < $R/zoo_cuda.log) lines run with matching gradients"
    grep -v ": runs / ok" $R/zoo_cuda.log | head -n 20
    cp /work/main/tests/fixtures/zoo/STATUS.cuda.tsv $R/ 2>/dev/null
fi
if [[ $what == *bench* ]]; then
    G=$X/graphrun
    for w in ${WORKLOADS:-llama_layer}; do
        (cd /work/main && $G inspect models/$w.yaml --dtype bf16 2>&1 | grep -E "^after passes|peak|plan")
        for p in fwd train; do
            flag=; [ $p = train ] && flag=--backward
            (cd /work/main && timeout 200 $G bench models/$w.yaml --backend cuda --dtype bf16 $flag \
                --iters 30 --warmup 5 --json $R/gr_${w}_$p.json 2>&1 | sed -n "/median/,+24p")
            # Each of TUNES (KEY=VALUE, space-separated) once more, as an A/B row.
            for t in ${TUNES:-}; do
                echo "-- with --tune $t"
                (cd /work/main && timeout 200 $G bench models/$w.yaml --backend cuda --dtype bf16 \
                    $flag --tune $t --iters 30 --warmup 5 --json $R/gr_${w}_${p}_${t//=/_}.json 2>&1 |
                    grep -E "median|peak memory")
            done
        done
        PYTHONUNBUFFERED=1 timeout 400 python3 $C/real_reference.py --workload $w --dtype bf16 \
            --pass fwd,train --mode eager,compile --json $R/torch_$w.json 2>&1 | tail -n 8
    done
fi
