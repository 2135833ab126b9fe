#!/usr/bin/env bash
# Fills DEST (default ../main/.carry-cuda, git-ignored there) with what
# scripts/device_cuda.sh needs on the device: stripped test executables and graphrun
# (bin.tgz), the files the tests read (tree/), torch_reference.py and the table script.
set -eu
cd "$(dirname "$0")/.."
DEST=${1:-../main/.carry-cuda}
cargo build --release
cargo test --release --no-run --message-format=json 2>/dev/null | python3 -c '
import sys, json
for l in sys.stdin:
    try: j = json.loads(l)
    except ValueError: continue
    if j.get("executable") and j.get("profile", {}).get("test"): print(j["executable"])
' > /tmp/carry_cuda_exes.txt
rm -rf "$DEST" /tmp/carry_cuda_bin && mkdir -p "$DEST/tree/tests" /tmp/carry_cuda_bin/tests
for f in $(cat /tmp/carry_cuda_exes.txt); do
    n=$(basename "$f"); n=${n%-*}
    [ -e /tmp/carry_cuda_bin/tests/$n ] && n=${n}_main
    cp "$f" /tmp/carry_cuda_bin/tests/$n
done
cp target/release/graphrun /tmp/carry_cuda_bin/graphrun
strip /tmp/carry_cuda_bin/graphrun /tmp/carry_cuda_bin/tests/*
tar czf "$DEST/bin.tgz" -C /tmp/carry_cuda_bin .
cp -r models examples README.md docs "$DEST/tree/"
cp -r tests/data tests/onnx_node tests/fixtures "$DEST/tree/tests/"
cp scripts/device_cuda.sh scripts/bench_table.py "$DEST/"
cp ../shared/bench/torch_reference.py "$DEST/"
du -sh "$DEST"
