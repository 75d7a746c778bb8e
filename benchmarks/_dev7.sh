set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 REPLAYSSM_COMMIT=wip-wlayout
for lay in row head; do
REPLAYSSM_WLAYOUT=$lay INPUT_DTYPE=float32 TAG=v29_wlayout_$lay SHAPES=nemotron3-super BATCHES=256,512,64 VARIANTS='[{}, {"flushpf": true}, {"ablate": 2}]' bash benchmarks/sweep_programs.sh
done
