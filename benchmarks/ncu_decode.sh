#!/usr/bin/env bash
# Nsight Compute on the replay and conventional decode kernels of one shape and batch (the
# tables' launch configs), window 16, staggered rows: occupancy, registers, DRAM throughput,
# warp stall reasons. Run on the GPU machine from the repository root:
#   OUT=/some/dir bash benchmarks/ncu_decode.sh qwen3.5-122b 256
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp}"
shape="$1"; batch="$2"
for kind in replay conventional; do
  ncu --clock-control none -k "regex:_${kind}_decode_kernel" --launch-skip 16 --launch-count 2 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis \
      python3 benchmarks/profile_decode.py "$shape" "$batch" > "$OUT/ncu_${shape}_${batch}_${kind}.txt" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|DRAM Throughput|Memory Throughput|Stall|Block Limit Reg|Warp Cycles Per Issued" \
      "$OUT/ncu_${shape}_${batch}_${kind}.txt" | head -24
done
