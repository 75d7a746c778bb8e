#!/usr/bin/env bash
# One GPU session: environment, GPU tests at real shapes, decode benchmark, record study.
# Run from the repository root on the GPU machine:  bash benchmarks/run_h200.sh [bench args]
# Results go to $OUT (or benchmarks/results/ when OUT is unset).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
STAGE="${STAGE:-all}"
if [[ "$STAGE" == all || "$STAGE" == test ]]; then
  python3 -m pytest -m gpu tests -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ "$STAGE" == all || "$STAGE" == bench ]]; then
  python3 -m replayssm.bench.decode --out "$OUT/decode_h200.json" "$@" 2>&1 | tee "$OUT/decode.log" | tail -60
fi
if [[ "$STAGE" == all || "$STAGE" == records ]]; then
  python3 -m replayssm.bench.records --out "$OUT/records_h200.json" 2>&1 | tail -20
fi
