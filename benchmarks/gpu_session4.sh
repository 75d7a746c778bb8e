# fourth sweep of this session (benchmarks/results/variants_v4_*.json): GDN records in chunks
# of BC up to the cursor (work follows h rather than the window)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SHAPES=qwen3.5-4b,qwen3.5-122b TAG=v4_gdn256 VARIANTS='[{"BV":32,"num_warps":4,"BC":0},{"BV":32,"num_warps":4,"BC":8},{"BV":32,"num_warps":4,"BC":4},{"BV":64,"num_warps":4,"BC":8},{"BV":32,"num_warps":4,"BC":8,"recmask":false},{"BV":32,"num_warps":4,"BC":16}]' bash benchmarks/sweep_programs.sh
SHAPES=qwen3.5-4b,qwen3.5-122b BATCHES=1,8 REPS=10 TAG=v4_gdn_small VARIANTS='[{"BV":16,"num_warps":1,"BC":0},{"BV":16,"num_warps":1,"BC":8},{"BV":16,"num_warps":1,"BC":4},{"BV":16,"num_warps":2,"BC":8}]' bash benchmarks/sweep_programs.sh
