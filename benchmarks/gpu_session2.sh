set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -m gpu tests/test_ops_mamba2.py tests/test_ops_delta.py -q -p no:cacheprovider -x 2>&1 | tail -4
S=bash
SHAPES=qwen3.5-4b,qwen3.5-122b,kimi-linear-48b TAG=delta256 VARIANTS='[{"BV":32,"num_warps":4,"HPP":1},{"BV":32,"num_warps":4,"HPP":2},{"BV":32,"num_warps":4,"HPP":4},{"BV":16,"num_warps":2,"HPP":1},{"BV":16,"num_warps":2,"HPP":2},{"BV":64,"num_warps":4,"HPP":1},{"BV":32,"num_warps":8,"HPP":1},{"BV":32,"num_warps":4,"HPP":2,"prefetch":true},{"BV":32,"num_warps":4,"HPP":1,"recmask":false}]' $S benchmarks/sweep_programs.sh
SHAPES=nemotron3-super,nemotron3-nano-4b TAG=mamba256 VARIANTS='[{"BV":64,"num_warps":4,"HPP":1},{"BV":64,"num_warps":4,"HPP":1,"recmask":false},{"BV":64,"num_warps":8,"HPP":1},{"BV":32,"num_warps":4,"HPP":1},{"BV":16,"num_warps":2,"HPP":4,"prefetch":true},{"BV":16,"num_warps":2,"HPP":1},{"BV":64,"num_warps":4,"HPP":2},{"BV":64,"num_warps":4,"HPP":1,"sync":2}]' $S benchmarks/sweep_programs.sh
SHAPES=nemotron3-super,nemotron3-nano-4b,qwen3.5-4b,qwen3.5-122b BATCHES=1 REPS=10 TAG=b1 VARIANTS='[{"BV":16,"num_warps":2,"HPP":1,"recmask":false},{"BV":16,"num_warps":2,"HPP":1,"recmask":false,"flush":"tf32x3"},{"BV":16,"num_warps":2,"HPP":1,"recmask":false,"sync":2},{"BV":32,"num_warps":4,"HPP":1,"recmask":false},{"BV":64,"num_warps":4,"HPP":1,"recmask":false}]' $S benchmarks/sweep_programs.sh
