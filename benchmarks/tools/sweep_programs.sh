#!/usr/bin/env bash
# Launch-config sweep of the replay kernels (heads per program, prefetch, record masking, tile
# sizes, flush path) against the conventional kernel measured in the same run, window 16:
#   OUT=/some/dir SHAPES=a,b BATCHES=256 VARIANTS='[{...}, ...]' TAG=name bash benchmarks/tools/sweep_programs.sh
# (INPUT_DTYPE=float32 for fp32 token inputs; default bfloat16, as the models pass them)
# Writes $OUT/variants_$TAG.json (see replayssm.bench.decode --variants; default OUT: scratch/,
# which git ignores). A variant whose keys do not apply to a family or shape is reported as
# failed and skipped.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-scratch}"
mkdir -p "$OUT"
python3 -m replayssm.bench.decode --shapes "$SHAPES" --batches "${BATCHES:-256}" --windows 16 \
  --reps "${REPS:-6}" --input-dtype "${INPUT_DTYPE:-bfloat16}" --variants "$VARIANTS" \
  --out "$OUT/variants_${TAG:-sweep}.json" 2>&1 \
  | grep -v "failed ValueError" | tail -60
