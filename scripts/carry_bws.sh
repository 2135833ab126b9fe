#!/usr/bin/env bash
# Fills DEST (default ../main/.carry-bws, git-ignored there) for scripts/device_bws.sh (the
# warp-specialized attention backward, session 5): graphrun and the attention test
# executables (stripped), the kernels precompiled for sm_90a (scripts/precompile_kernels.py).
set -eu
cd "$(dirname "$0")/.."
DEST=${1:-../main/.carry-bws}
cargo build --release
cargo test --release --no-run --message-format=json --test cuda --test ops_attention --test ops_attention_grad --test grad 2>/dev/null | python3 -c '
import sys, json
for l in sys.stdin:
    try: j = json.loads(l)
    except ValueError: continue
    if j.get("executable") and j.get("profile", {}).get("test"): print(j["executable"])
' > /tmp/carry_bws_exes.txt
rm -rf "$DEST" /tmp/carry_bws_bin && mkdir -p "$DEST" /tmp/carry_bws_bin/tests
for f in $(cat /tmp/carry_bws_exes.txt); do n=$(basename "$f"); cp "$f" /tmp/carry_bws_bin/tests/${n%-*}; done
cp ${CARGO_TARGET_DIR:-target}/release/graphrun /tmp/carry_bws_bin/graphrun
strip /tmp/carry_bws_bin/graphrun /tmp/carry_bws_bin/tests/*
tar czf "$DEST/bin.tgz" -C /tmp/carry_bws_bin .
python3 scripts/precompile_kernels.py "$DEST/kcache"
cp scripts/device_bws.sh "$DEST/"
du -sh "$DEST"
