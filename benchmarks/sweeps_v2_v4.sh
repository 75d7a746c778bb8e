#!/usr/bin/env bash
# The launch-config sweeps behind the tables of replayssm/ops/{mamba2,gdn}/decode.py
# (benchmarks/results/variants_v2_*, _v3_*, _v4_*.json; one H200). Run from the repository
# root on the GPU machine: OUT=/some/dir STAGE=v2|v3|v4 bash benchmarks/sweeps_v2_v4.sh
# (v2_small / v2_large were the first sweep of the v2 design: benchmarks/sweep_programs.sh
# with the lists recorded in those JSON files.)
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
S="bash benchmarks/sweep_programs.sh"
case "${STAGE:-v4}" in
v2)  # heads per program, V-block size, record masking, at batch 256 and batch 1
  SHAPES=qwen3.5-4b,qwen3.5-122b,kimi-linear-48b TAG=v2_delta256 VARIANTS='[{"BV":32,"num_warps":4,"HPP":1},{"BV":32,"num_warps":4,"HPP":2},{"BV":32,"num_warps":4,"HPP":4},{"BV":16,"num_warps":2,"HPP":1},{"BV":16,"num_warps":2,"HPP":2},{"BV":64,"num_warps":4,"HPP":1},{"BV":32,"num_warps":8,"HPP":1},{"BV":32,"num_warps":4,"HPP":2,"prefetch":true},{"BV":32,"num_warps":4,"HPP":1,"recmask":false}]' $S
  SHAPES=nemotron3-super,nemotron3-nano-4b TAG=v2_mamba256 VARIANTS='[{"BV":64,"num_warps":4,"HPP":1},{"BV":64,"num_warps":4,"HPP":1,"recmask":false},{"BV":64,"num_warps":8,"HPP":1},{"BV":32,"num_warps":4,"HPP":1},{"BV":16,"num_warps":2,"HPP":4,"prefetch":true},{"BV":16,"num_warps":2,"HPP":1},{"BV":64,"num_warps":4,"HPP":2},{"BV":64,"num_warps":4,"HPP":1,"sync":2}]' $S
  SHAPES=nemotron3-super,nemotron3-nano-4b,qwen3.5-4b,qwen3.5-122b BATCHES=1 REPS=10 TAG=v2_b1 VARIANTS='[{"BV":16,"num_warps":2,"HPP":1,"recmask":false},{"BV":16,"num_warps":2,"HPP":1,"recmask":false,"flush":"tf32x3"},{"BV":16,"num_warps":2,"HPP":1,"recmask":false,"sync":2},{"BV":32,"num_warps":4,"HPP":1,"recmask":false},{"BV":64,"num_warps":4,"HPP":1,"recmask":false}]' $S
  ;;
v3)  # bigger V-blocks for the delta rule (L1-bound per ncu), more heads per program for Nano-4B, one warp at batch 1
  SHAPES=qwen3.5-4b,qwen3.5-122b,kimi-linear-48b TAG=v3_delta256 VARIANTS='[{"BV":32,"num_warps":4,"HPP":1},{"BV":128,"num_warps":8,"HPP":1},{"BV":128,"num_warps":4,"HPP":1},{"BV":64,"num_warps":8,"HPP":1},{"BV":128,"num_warps":8,"HPP":2},{"BV":64,"num_warps":4,"HPP":2},{"BV":128,"num_warps":16,"HPP":1}]' $S
  SHAPES=nemotron3-nano-4b,nemotron3-super TAG=v3_mamba256 VARIANTS='[{"BV":16,"num_warps":2,"HPP":4,"prefetch":true},{"BV":16,"num_warps":2,"HPP":12,"prefetch":true},{"BV":16,"num_warps":2,"HPP":6,"prefetch":true},{"BV":16,"num_warps":1,"HPP":4,"prefetch":true},{"BV":16,"num_warps":2,"HPP":2,"prefetch":true},{"BV":64,"num_warps":4,"HPP":1},{"BV":128,"num_warps":8,"HPP":1},{"BV":64,"num_warps":2,"HPP":1}]' $S
  SHAPES=nemotron3-super,qwen3.5-4b BATCHES=1 REPS=10 TAG=v3_b1 VARIANTS='[{"BV":16,"num_warps":1,"HPP":1,"recmask":false},{"BV":32,"num_warps":1,"HPP":1,"recmask":false},{"BV":16,"num_warps":2,"HPP":1,"recmask":false}]' $S
  ;;
v4)  # GDN records in chunks of BC up to the cursor
  SHAPES=qwen3.5-4b,qwen3.5-122b TAG=v4_gdn256 VARIANTS='[{"BV":32,"num_warps":4,"BC":0},{"BV":32,"num_warps":4,"BC":8},{"BV":32,"num_warps":4,"BC":4},{"BV":64,"num_warps":4,"BC":8},{"BV":32,"num_warps":4,"BC":8,"recmask":false},{"BV":32,"num_warps":4,"BC":16}]' $S
  SHAPES=qwen3.5-4b,qwen3.5-122b BATCHES=1,8 REPS=10 TAG=v4_gdn_small VARIANTS='[{"BV":16,"num_warps":1,"BC":0},{"BV":16,"num_warps":1,"BC":8},{"BV":16,"num_warps":1,"BC":4},{"BV":16,"num_warps":2,"BC":8}]' $S
  ;;
esac
