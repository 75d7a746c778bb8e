#!/usr/bin/env bash
# Launch-config sweep of the replay kernels (heads per program, prefetch, record masking, tile
# sizes) against the conventional kernel, at small and large batch, window 16, in one GPU call:
#   OUT=/some/dir bash benchmarks/sweep_programs.sh
# Writes $OUT/variants_small.json and $OUT/variants_large.json (see replayssm.bench.decode --variants).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SHAPES="${SHAPES:-nemotron3-super,nemotron3-nano-4b,qwen3.5-4b,qwen3.5-122b,kimi-linear-48b}"
SMALL='[{"BV":16,"num_warps":2,"HPP":1,"recmask":false,"prefetch":false},
 {"BV":16,"num_warps":2,"HPP":1,"recmask":true,"prefetch":false},
 {"BV":32,"num_warps":4,"HPP":1,"recmask":false,"prefetch":false},
 {"BV":8,"num_warps":1,"HPP":1,"recmask":false,"prefetch":false},
 {"BV":16,"num_warps":4,"HPP":1,"recmask":false,"prefetch":false}]'
LARGE='[{"BV":32,"num_warps":4,"HPP":1,"recmask":true,"prefetch":false},
 {"BV":32,"num_warps":4,"HPP":2,"recmask":true,"prefetch":true},
 {"BV":32,"num_warps":4,"HPP":4,"recmask":true,"prefetch":true},
 {"BV":32,"num_warps":4,"HPP":4,"recmask":true,"prefetch":false},
 {"BV":64,"num_warps":4,"HPP":1,"recmask":true,"prefetch":false},
 {"BV":64,"num_warps":8,"HPP":4,"recmask":true,"prefetch":true},
 {"BV":16,"num_warps":2,"HPP":4,"recmask":true,"prefetch":true},
 {"BV":32,"num_warps":8,"HPP":4,"recmask":true,"prefetch":true},
 {"BV":32,"num_warps":4,"HPP":8,"recmask":true,"prefetch":true},
 {"BV":32,"num_warps":4,"HPP":4,"recmask":false,"prefetch":true},
 {"BV":32,"num_warps":4,"HPP":4,"recmask":true,"prefetch":true,"flush":"tf32x3"},
 {"BV":32,"num_warps":4,"HPP":4,"recmask":true,"prefetch":true,"sync":2}]'
python3 -m replayssm.bench.decode --shapes "$SHAPES" --batches 1,8 --windows 16 --reps 10 \
  --variants "$SMALL" --out "$OUT/variants_small.json" 2>&1 | grep -v "^ *$" | tail -60
python3 -m replayssm.bench.decode --shapes "$SHAPES" --batches 256 --windows 16 --reps 6 \
  --variants "$LARGE" --out "$OUT/variants_large.json" 2>&1 | grep -v "^ *$" | tail -70
