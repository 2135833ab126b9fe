#!/usr/bin/env bash
# Fills DEST (default ../main/.carry-tf32, git-ignored there) for scripts/device_tf32.sh:
# graphrun and the attention/grad test executables (stripped), the kernels precompiled for
# sm_90a (scripts/precompile_kernels.py; NVRTC names libnvrtc.so.13 here). BASE=DIR (a
# carry folder of this script from an earlier commit) adds its graphrun (base.tgz) and
# kernels, to be measured side by side.
set -eu
cd "$(dirname "$0")/.."
DEST=${1:-../main/.carry-tf32}
cargo build --release
cargo test --release --no-run --message-format=json --test cuda --test cuda_3xtf32 --test cuda_f32_simt --test ops_attention --test ops_attention_grad --test grad 2>/dev/null | python3 -c '
import sys, json
for l in sys.stdin:
    try: j = json.loads(l)
    except ValueError: continue
    if j.get("executable") and j.get("profile", {}).get("test"): print(j["executable"])
' > /tmp/carry_tf32_exes.txt
rm -rf "$DEST" /tmp/carry_tf32_bin && mkdir -p "$DEST" /tmp/carry_tf32_bin/tests
for f in $(cat /tmp/carry_tf32_exes.txt); do n=$(basename "$f"); cp "$f" /tmp/carry_tf32_bin/tests/${n%-*}; done
cp ${CARGO_TARGET_DIR:-target}/release/graphrun /tmp/carry_tf32_bin/graphrun
strip /tmp/carry_tf32_bin/graphrun /tmp/carry_tf32_bin/tests/*
tar czf "$DEST/bin.tgz" -C /tmp/carry_tf32_bin .
python3 scripts/precompile_kernels.py "$DEST/kcache"
if [ -n "${BASE:-}" ]; then
    rm -rf /tmp/carry_tf32_base && mkdir -p /tmp/carry_tf32_base
    tar xzf "$BASE/bin.tgz" -C /tmp/carry_tf32_base ./graphrun
    tar czf "$DEST/base.tgz" -C /tmp/carry_tf32_base graphrun
    cp -n "$BASE"/kcache/*.cubin "$DEST/kcache/"
fi
cp scripts/device_tf32.sh "$DEST/"
du -sh "$DEST"
