#!/usr/bin/env bash
# Packs DEST/bin.txz from this tree's builds: target/release/graphrun, the test executables
# TESTS names (test profile; "lib" the library's unit tests) and BASE_BIN as graphrun_base if given, stripped. Part of
# scripts/carry_ops.sh; alone, it refreshes a carry after a source change that left the
# kernels (DEST/kcache) as they were.
#   TESTS="cuda zoo" [BASE_BIN=PATH] scripts/pack_bin.sh DEST
set -eu
cd "$(dirname "$0")/.."
DEST=${1:?DEST}
TESTS=${TESTS:-"cuda"}
cargo build --release
B=$(mktemp -d)
mkdir -p "$B/tests"
# "lib" names the library's own unit tests (run them on the device with a filter).
cargo test --no-run $(for t in $TESTS; do [ $t = lib ] && echo --lib || echo --test $t; done) --message-format=json 2>/dev/null |
    python3 -c '
import sys, json
for l in sys.stdin:
    try: j = json.loads(l)
    except ValueError: continue
    if j.get("executable") and j.get("profile", {}).get("test"): print(j["executable"])
' | while read -r f; do n=$(basename "$f"); cp "$f" "$B/tests/${n%-*}"; done
cp target/release/graphrun "$B/graphrun"
[ -n "${BASE_BIN:-}" ] && cp "$BASE_BIN" "$B/graphrun_base"
strip "$B"/graphrun* "$B"/tests/*
tar cf - -C "$B" . | xz -T2 -9e > "$DEST/bin.txz"
rm -rf "$B"
du -sh "$DEST"
