#!/usr/bin/env bash
# One GPU session in one call: GPU tests at real shapes, the 16K-step record-precision study,
# the decode benchmark with the launch-config tables (benchmarks/sweep_programs.sh sweeps
# them). About 8 minutes on an H200. Run from the repository root on the GPU machine:
#   OUT=/some/dir STAGE=all bash benchmarks/run_h200.sh
# STAGE: all | test | bench | records. Results go to $OUT (default benchmarks/results/).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results}"
STAGE="${STAGE:-all}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [[ "$STAGE" == all || "$STAGE" == test ]]; then
  python3 -m pytest -m gpu tests -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
fi
if [[ "$STAGE" == all || "$STAGE" == records ]]; then
  python3 -m replayssm.bench.records --steps 16384 --out "$OUT/records_h200.json" 2>&1 | tail -14
fi
if [[ "$STAGE" == all || "$STAGE" == bench ]]; then
  python3 -m replayssm.bench.decode --reps 8 --out "$OUT/decode_h200.json" 2>&1 \
    | tee "$OUT/decode.log" | grep -v " L=" | tail -35
fi
