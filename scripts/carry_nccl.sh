#!/usr/bin/env bash
# Fills .carry-nccl/ (git-ignored) with what scripts/device_nccl.sh needs on the device:
# graphrun and the data-parallel and training test executables (test profile, stripped,
# bin.txz by scripts/pack_bin.sh), kernels precompiled for sm_90a, the DDP reference and
# the bench's torch_reference.py it imports.
set -eu
cd "$(dirname "$0")/.."
D=.carry-nccl
rm -rf $D && mkdir -p $D
TESTS="parallel training_state" scripts/pack_bin.sh $D
NV=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13/lib'))" 2>/dev/null || true)
if [ -n "$NV" ] && [ -e "$NV/libnvrtc.so.13" ]; then
    LD_LIBRARY_PATH=$NV NVRTC=$NV/libnvrtc.so.13 python3 scripts/precompile_kernels.py "$D/kcache" >/dev/null
fi
cp scripts/device_nccl.sh scripts/ddp_reference.py ../shared/bench/torch_reference.py $D/
du -sh $D
