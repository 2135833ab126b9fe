#!/usr/bin/env bash
# Runs every carried test executable and the CUDA benchmarks on the device machine (the
# `run` tool), from the repository root. Build here first, then carry dev-bin/:
#   cargo test --no-run --message-format=json   (executables), cargo build --release
#   tar czf dev-bin/devbin.tgz tests/<executables> graphrun
# GRAPHRUN_REQUIRE_CUDA makes a missing GPU a failure rather than a skip.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/devbin
tar xzf dev-bin/devbin.tgz -C /tmp/devbin
# The executables carry this checkout's absolute path for their data files.
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
export GRAPHRUN_REQUIRE_CUDA=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
/tmp/devbin/graphrun doctor 2>&1 | tail -n 8
status=0
for t in /tmp/devbin/tests/*; do
    name=$(basename "$t")
    (cd /work/main && timeout 240 "$t" --test-threads=8) >"$OUT/$name.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "== $name rc=$rc $(grep -E '^test result' "$OUT/$name.log" | tail -n 1)"
    grep -E "^test .* FAILED$|panicked at" "$OUT/$name.log" | head -n 12
done
for m in mlp attention; do
    for dt in f32 bf16; do
        echo "== bench $m $dt"
        (cd /work/main && timeout 60 /tmp/devbin/graphrun bench "models/$m.yaml" --backend cuda --dtype $dt --iters 20 --warmup 3 2>&1 | head -n 6)
    done
done
exit $status
