#!/usr/bin/env bash
# Runs the fuzz targets (fuzz/fuzz_targets; cargo-fuzz + libFuzzer, nightly) for a bounded
# time and prints executions, coverage and findings per target. Crashes land in
# fuzz/artifacts/<target>/; each finding becomes a regression test (tests/bad_input.rs,
# tests/onnx_import.rs, tests/passes_random.rs).
#
#   scripts/fuzz.sh [SECONDS] [JOBS]
#       build with cargo-fuzz, then run each target in turn (default 300 s, 1 job)
#   scripts/fuzz.sh pack DEST.tar.gz
#       build, then pack the stripped binaries, the seeded corpora and this script, to run
#       on a machine without Rust (the binaries need only libc, libm, libgcc_s, libstdc++)
#   scripts/fuzz.sh parallel SECONDS WORKERS [TARGET[:W] ...]
#       run the already-built targets (default: all) at once, WORKERS libFuzzer processes
#       each (TARGET:W overrides), all sharing the target's corpus; then print per target
#       the wall time x workers, the executions summed over workers, coverage (cov/ft, the
#       best worker) and the crash files. Logs go to fuzz/logs/<target>/fuzz-<N>.log.
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
start=$PWD
cd "$root/fuzz"
targets="yaml_model npy safetensors random_graphs onnx"
bin="$root/fuzz/target/x86_64-unknown-linux-gnu/release"
# Inputs larger than any seed only slow the mutators down; the ONNX seeds reach ~130 KB.
max_len() { if [ "$1" = onnx ]; then echo 196608; else echo 8192; fi; }

# Seed corpora: the models and test YAML files for the loader; for the ONNX importer the
# exported fixtures and a few of ONNX's own node-test models.
seed() {
    for t in $targets; do mkdir -p "corpus/$t" "artifacts/$t"; done
    cp ../models/*.yaml ../tests/data/*.yaml corpus/yaml_model/ 2>/dev/null
    for d in ../tests/fixtures/onnx/*/; do cp "$d/model.onnx" "corpus/onnx/$(basename "$d").onnx"; done
    # ONNX's node tests come from the onnx wheel (as for tests/onnx_conformance.rs).
    local node="${GRAPHRUN_ONNX_NODE_TESTS:-$(python3 -c \
        'import os, onnx; print(os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/node"))' 2>/dev/null)}"
    if [ -d "$node" ]; then
        for n in add_bcast cast_DOUBLE_to_FLOAT concat_2d_axis_0 expand_dim_changed gather_0 \
            gelu_tanh_1 gemm_default_no_bias layer_normalization_2d_axis0 matmul_2d relu \
            reduce_mean_default_axes_keepdims_example reshape_reordered_all_dims slice \
            softmax_axis_1 transpose_default unsqueeze_axis_0 where_example \
            conv_with_strides_padding convtranspose_pads maxpool_2d_pads \
            averagepool_2d_ceil resize_upsample_scales_linear batchnorm_epsilon \
            instancenorm_example group_normalization_example depthtospace_example; do
            cp "$node/test_$n/model.onnx" "corpus/onnx/test_$n.onnx"
        done
    else
        echo "no ONNX node tests (pip install onnx==1.22.0, or set GRAPHRUN_ONNX_NODE_TESTS):" \
            "the onnx corpus starts from the fixtures only" >&2
    fi
    # Readers: fixture arrays (f32 and i64), and a hand-made two-tensor .safetensors file
    # (u64 header length, JSON header, data), so that a fresh checkout gets past the magic.
    for f in mlp_gelu_torchscript/in_0 embed_ce_torchscript/in_0 embed_ce_torchscript/out_0; do
        cp "../tests/fixtures/onnx/$f.npy" "corpus/npy/${f//\//_}.npy"
    done
    h='{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"i":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}}'
    { printf "\\x$(printf %02x ${#h})\\0\\0\\0\\0\\0\\0\\0"; printf '%s' "$h"
      printf '\0\0\200\077\0\0\0\100\7\0\0\0\0\0\0\0'; } >corpus/safetensors/seed.safetensors
}

build() { seed && cargo +nightly fuzz build -O; }

case "${1:-}" in
pack)
    dest=$(cd "$start" && realpath -m "${2:?pack DEST.tar.gz}")
    build || exit 1
    stage=$(mktemp -d)
    mkdir -p "$stage/scripts" "$stage/fuzz/target/x86_64-unknown-linux-gnu/release"
    cp "$root/scripts/fuzz.sh" "$stage/scripts/"
    for t in $targets; do
        strip -o "$stage/fuzz/target/x86_64-unknown-linux-gnu/release/$t" "$bin/$t"
    done
    cp -r corpus "$stage/fuzz/"
    tar czf "$dest" -C "$stage" scripts fuzz
    rm -rf "$stage"
    ls -l "$dest"
    ;;
parallel)
    secs=${2:?parallel SECONDS WORKERS}
    workers=${3:?parallel SECONDS WORKERS}
    shift 3
    list=${*:-$targets}
    for tw in $list; do
        t=${tw%%:*}
        w=$workers
        [ "$tw" != "$t" ] && w=${tw#*:}
        mkdir -p "corpus/$t" "artifacts/$t" "logs/$t"
        # -jobs=W -workers=W: W independent processes, each stopping at -max_total_time,
        # sharing (and reloading) one corpus folder. `timeout` only guards against a
        # worker stuck past its time; libFuzzer's own -timeout catches slow inputs.
        (cd "logs/$t" && timeout -k 10 $((secs + 30)) "$bin/$t" "$root/fuzz/corpus/$t" \
            -jobs="$w" -workers="$w" -max_total_time="$secs" -max_len="$(max_len "$t")" \
            -rss_limit_mb=4096 -timeout=20 -print_final_stats=1 \
            -artifact_prefix="$root/fuzz/artifacts/$t/" >runner.log 2>&1) &
    done
    wait
    for tw in $list; do
        t=${tw%%:*}
        w=$(ls logs/"$t"/fuzz-*.log 2>/dev/null | wc -l)
        # Each worker's last status line: "#N DONE cov: C ft: F corp: K/S ..." (or its last
        # "#N ..." line if it was stopped) and its final stats; executions are summed,
        # coverage is the best worker's.
        execs=0 cov=0 ft=0
        for l in logs/"$t"/fuzz-*.log; do
            last=$(grep -E '^#[0-9]+' "$l" | tail -n 1)
            n=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+)/\1/p' "$l")
            [ -z "$n" ] && n=$(sed -E 's/^#([0-9]+).*/\1/' <<<"$last")
            c=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")
            f=$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$last")
            execs=$((execs + ${n:-0}))
            [ "${c:-0}" -gt "$cov" ] && cov=$c
            [ "${f:-0}" -gt "$ft" ] && ft=$f
        done
        files=$(ls "corpus/$t" | wc -l)
        bytes=$(du -sb "corpus/$t" | cut -f1)
        crashes=$(ls "artifacts/$t" | wc -l)
        echo "$t: ${secs} s x $w workers, executions $execs, cov $cov ft $ft (best worker)," \
            "corpus $files files $bytes bytes, artifacts $crashes"
        grep -hE "ERROR: libFuzzer|panicked at|deadly signal|Test unit written" logs/"$t"/fuzz-*.log | sort | uniq -c | head -n 10
        ls "artifacts/$t" | head -n 10
    done
    ;;
*)
    secs=${1:-300}
    jobs=${2:-1}
    build || exit 1
    for t in $targets; do
        log=$(mktemp)
        cargo +nightly fuzz run -O "$t" -- -max_total_time="$secs" -jobs="$jobs" -workers="$jobs" \
            -max_len="$(max_len "$t")" -rss_limit_mb=4096 -timeout=20 >"$log" 2>&1
        rc=$?
        # libFuzzer's last status line: "#N DONE cov: C ft: F corp: K/..."
        done=$(grep -E "DONE|#[0-9]+" "$log" | tail -n 1)
        echo "$t: rc=$rc $done"
        grep -E "ERROR|panicked|deadly signal" "$log" | head -n 5
        ls "artifacts/$t" 2>/dev/null | head -n 5
        rm -f "$log"
    done
    ;;
esac
