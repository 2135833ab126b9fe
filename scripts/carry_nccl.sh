#!/usr/bin/env bash
# Fills .carry-nccl/ (git-ignored) with what scripts/device_nccl.sh needs on the device:
# graphrun and the data-parallel test executable (stripped, bin.tgz), the DDP reference
# and the bench's torch_reference.py it imports.
set -eu
cd "$(dirname "$0")/.."
D=.carry-nccl
cargo build --release
exe=$(cargo test --release --no-run --test parallel --message-format=json 2>/dev/null | python3 -c '
import sys, json
for l in sys.stdin:
    try: j = json.loads(l)
    except ValueError: continue
    if j.get("executable") and j.get("profile", {}).get("test"): print(j["executable"])')
rm -rf $D /tmp/carry_nccl && mkdir -p $D /tmp/carry_nccl/tests
cp "$exe" /tmp/carry_nccl/tests/parallel
cp target/release/graphrun /tmp/carry_nccl/graphrun
strip /tmp/carry_nccl/graphrun /tmp/carry_nccl/tests/*
tar czf $D/bin.tgz -C /tmp/carry_nccl .
cp scripts/device_nccl.sh scripts/ddp_reference.py ../shared/bench/torch_reference.py $D/
du -sh $D
