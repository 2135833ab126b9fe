#!/usr/bin/env bash
# One device call that profiles the bf16 attention kernels of one training step under
# Nsight Compute with the full section set and source-level (SASS) warp-stall sampling:
# the forward (fa_fwd_wsp) and the backward (fa_bwsp) each once (KERNELS: regular expressions), then the details page and the
# per-instruction source page as CSV under $OUT. Carried by
#   TESTS=cuda scripts/carry_attn.sh ../main/.carry-prof device_prof.sh
# and run as  [KERNELS="fa_fwd_wsp fa_bwsp"] [MODEL=attention] bash .carry-prof/device_prof.sh
set -u
C=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
X=/tmp/prof_x KC=/tmp/prof_kcache R=$OUT/prof
rm -rf "$X" "$KC"
mkdir -p "$R" "$X" "$KC"
tar xzf "$C/bin.tgz" -C "$X"
cp "$C"/kcache/*.cubin "$KC"/ 2>/dev/null
export GRAPHRUN_REQUIRE_CUDA=1 GRAPHRUN_CUDA_CACHE=$KC
G=$X/graphrun
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
ncu --version | tail -n 1
for k in ${KERNELS:-fa_fwd_wsp fa_bwsp}; do
    timeout 240 ncu --set full --import-source no -k regex:"$k" -c 1 -f -o $R/$k \
        $G bench models/${MODEL:-attention}.yaml --backend cuda --dtype bf16 --backward --iters 1 --warmup 0 \
        > $R/$k.log 2>&1
    echo "ncu $k rc=$?"
    ncu -i $R/$k.ncu-rep --page details --csv > $R/${k}_details.csv 2>&1
    ncu -i $R/$k.ncu-rep --page source --csv --print-source sass > $R/${k}_sass.csv 2>&1
    ls -la $R/${k}_*.csv
    head -c 600 $R/${k}_sass.csv; echo
done
