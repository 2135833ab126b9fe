#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for a bounded time with cargo-fuzz
# (libFuzzer; needs a nightly toolchain and `cargo install cargo-fuzz`), and prints
# executions, coverage and findings per target. Crashes land in fuzz/artifacts/<target>/;
# each finding becomes a regression test (tests/bad_input.rs, tests/passes_random.rs).
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [JOBS]      (default 300 s, 1 job)
set -u
cd "$(dirname "$0")/../fuzz"
secs=${1:-300}
jobs=${2:-1}
# Seed corpora: the models and test YAML files for the loader.
mkdir -p corpus/yaml_model corpus/npy corpus/safetensors corpus/random_graphs
cp ../models/*.yaml ../tests/data/*.yaml corpus/yaml_model/ 2>/dev/null
cargo +nightly fuzz build -O || exit 1
for t in yaml_model npy safetensors random_graphs; do
    log=$(mktemp)
    cargo +nightly fuzz run -O "$t" -- -max_total_time="$secs" -jobs="$jobs" -workers="$jobs" \
        -max_len=8192 -rss_limit_mb=4096 -timeout=20 >"$log" 2>&1
    rc=$?
    # libFuzzer's last status line: "#N DONE cov: C ft: F corp: K/..."
    done=$(grep -E "DONE|#[0-9]+" "$log" | tail -n 1)
    echo "$t: rc=$rc $done"
    grep -E "ERROR|panicked|deadly signal" "$log" | head -n 5
    ls "artifacts/$t" 2>/dev/null | head -n 5
    rm -f "$log"
done
