# third sweep of this session (benchmarks/results/variants_v3_*.json): bigger V-blocks for the
# delta-rule kernels (L1-bound per ncu: fewer key-tile reads per checkpoint byte), more heads
# per program for Nano-4B
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
S=bash
SHAPES=qwen3.5-4b,qwen3.5-122b,kimi-linear-48b TAG=v3_delta256 VARIANTS='[{"BV":32,"num_warps":4,"HPP":1},{"BV":128,"num_warps":8,"HPP":1},{"BV":128,"num_warps":4,"HPP":1},{"BV":64,"num_warps":8,"HPP":1},{"BV":128,"num_warps":8,"HPP":2},{"BV":64,"num_warps":4,"HPP":2},{"BV":128,"num_warps":16,"HPP":1}]' $S benchmarks/sweep_programs.sh
SHAPES=nemotron3-nano-4b,nemotron3-super TAG=v3_mamba256 VARIANTS='[{"BV":16,"num_warps":2,"HPP":4,"prefetch":true},{"BV":16,"num_warps":2,"HPP":12,"prefetch":true},{"BV":16,"num_warps":2,"HPP":6,"prefetch":true},{"BV":16,"num_warps":1,"HPP":4,"prefetch":true},{"BV":16,"num_warps":2,"HPP":2,"prefetch":true},{"BV":64,"num_warps":4,"HPP":1},{"BV":128,"num_warps":8,"HPP":1},{"BV":64,"num_warps":2,"HPP":1}]' $S benchmarks/sweep_programs.sh
SHAPES=nemotron3-super,qwen3.5-4b BATCHES=1 REPS=10 TAG=v3_b1 VARIANTS='[{"BV":16,"num_warps":1,"HPP":1,"recmask":false},{"BV":32,"num_warps":1,"HPP":1,"recmask":false},{"BV":16,"num_warps":2,"HPP":1,"recmask":false}]' $S benchmarks/sweep_programs.sh
