#!/usr/bin/env bash
# Fills DEST (default ../main/.carry-wgpu, git-ignored there) with what
# scripts/device_wgpu.sh needs: stripped graphrun (release) and the WebGPU test
# executables (bins.tgz), the Vulkan loader .debs (gl/, fetched once), the files the tests
# and benches read (tree/).
set -eu
cd "$(dirname "$0")/.."
DEST=${1:-../main/.carry-wgpu}
TESTS="wgpu wgpu_subgroups ops_matmul ops_elementwise ops_reduce ops_shape ops_attention ops_attention_grad ops_misc ops_grad"
cargo build --release --bin graphrun
cargo test --no-run --message-format=json $(for t in $TESTS; do echo --test $t; done) 2>/dev/null | python3 -c '
import sys, json
for l in sys.stdin:
    try: j = json.loads(l)
    except ValueError: continue
    if j.get("executable") and j.get("profile", {}).get("test"): print(j["executable"])
' > /tmp/carry_wgpu_exes.txt
T=${CARGO_TARGET_DIR:-target}
rm -rf /tmp/carry_wgpu_bin "$DEST/tree" "$DEST/bins.tgz" && mkdir -p "$DEST/tree/tests" /tmp/carry_wgpu_bin/tests
for f in $(cat /tmp/carry_wgpu_exes.txt); do
    n=$(basename "$f"); cp "$f" /tmp/carry_wgpu_bin/tests/${n%-*}
done
cp "$T/release/graphrun" /tmp/carry_wgpu_bin/graphrun
# BASE=path/to/graphrun: another build to bench beside this one (before/after).
[ -n "${BASE:-}" ] && cp "$BASE" /tmp/carry_wgpu_bin/graphrun_base
strip /tmp/carry_wgpu_bin/graphrun* /tmp/carry_wgpu_bin/tests/*
tar czf "$DEST/bins.tgz" -C /tmp/carry_wgpu_bin .
cp -r models "$DEST/tree/"
cp -r tests/common tests/data "$DEST/tree/tests/"
cp scripts/device_wgpu.sh scripts/nvidia_vulkan.sh "$DEST/"
pwd > "$DEST/worktree" # where the test executables look for tree/ (CARGO_MANIFEST_DIR)
if [ ! -d "$DEST/gl" ]; then
    mkdir -p "$DEST/gl" /tmp/amd64/partial
    o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    apt-get $o update -qq
    (cd "$DEST/gl" && apt-get $o download libvulkan1)
fi
du -sh "$DEST"
