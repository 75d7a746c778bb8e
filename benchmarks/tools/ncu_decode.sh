#!/usr/bin/env bash
# Nsight Compute on the replay and conventional decode kernels of one shape and batch (the
# tables' launch configs), window 16, staggered rows: occupancy, registers, DRAM throughput,
# warp stall reasons. Run on the GPU machine from the repository root:
#   OUT=/some/dir bash benchmarks/tools/ncu_decode.sh qwen3.5-122b 256
# KREGEX overrides the replay kernel's name regex (default `_replay_decode_kernel`; the
# Gluon kernels the tables take at large batches are `_gluon_replay_kernel` (Mamba-2) and
# `_gluon_gdn_kernel`; the eager step at small batches runs `_conventional_decode_kernel`).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp}"
shape="$1"; batch="$2"
for kind in replay conventional; do
  regex="_${kind}_decode_kernel"
  [[ $kind == replay && -n "${KREGEX:-}" ]] && regex="$KREGEX"
  ncu --clock-control none -k "regex:$regex" --launch-skip 16 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis \
      python3 benchmarks/tools/profile_decode.py "$shape" "$batch" > "$OUT/ncu_${shape}_${batch}_${kind}.txt" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|DRAM Throughput|Memory Throughput|Stall|Block Limit Reg|Warp Cycles Per Issued" \
      "$OUT/ncu_${shape}_${batch}_${kind}.txt" | head -24
done
