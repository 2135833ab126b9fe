#!/usr/bin/env bash
# Fills DEST (default ../main/.carry-attn, git-ignored there) for one of the attention
# device scripts, DEVICE (default device_attn.sh; device_ab.sh compares this build with a
# BASE build and `--tune cuda_attention=MODE` modes; device_tf32.sh the f32/tf32 runs): graphrun and the attention/grad test executables (stripped; TESTS names them),
# the kernels precompiled for sm_90a (scripts/precompile_kernels.py; NVRTC names
# libnvrtc.so.13 here). BASE=DIR (a carry folder of this script from an earlier commit)
# adds its graphrun (base.tgz) and kernels, to measure side by side.
#   [TESTS="cuda ..."] [BASE=DIR] scripts/carry_attn.sh [DEST] [DEVICE]
set -eu
cd "$(dirname "$0")/.."
DEST=${1:-../main/.carry-attn}
DEVICE=${2:-device_attn.sh}
TESTS=${TESTS:-cuda ops_attention ops_attention_grad grad}
# (own temporary folder: several of these may run at once from different worktrees)
T=$(mktemp -d /tmp/carry_attn.XXXXXX)
trap 'rm -rf "$T"' EXIT
cargo build --release
cargo test --release --no-run --message-format=json $(printf -- '--test %s ' $TESTS) 2>/dev/null | python3 -c '
import sys, json
for l in sys.stdin:
    try: j = json.loads(l)
    except ValueError: continue
    if j.get("executable") and j.get("profile", {}).get("test"): print(j["executable"])
' > $T/exes.txt
rm -rf "$DEST" $T/bin && mkdir -p "$DEST" $T/bin/tests
for f in $(cat $T/exes.txt); do n=$(basename "$f"); cp "$f" $T/bin/tests/${n%-*}; done
cp ${CARGO_TARGET_DIR:-target}/release/graphrun $T/bin/graphrun
strip $T/bin/graphrun $T/bin/tests/*
tar czf "$DEST/bin.tgz" -C $T/bin .
python3 scripts/precompile_kernels.py "$DEST/kcache"
if [ -n "${BASE:-}" ]; then
    rm -rf $T/base && mkdir -p $T/base
    tar xzf "$BASE/bin.tgz" -C $T/base ./graphrun
    tar czf "$DEST/base.tgz" -C $T/base graphrun
    cp -n "$BASE"/kcache/*.cubin "$DEST/kcache/"
fi
cp "scripts/$DEVICE" "$DEST/"
du -sh "$DEST"
