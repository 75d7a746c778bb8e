#!/bin/bash
# Trains the shipped models (replayssm/integrations/hf/trained/: a main model and a draft per
# family) on one GPU in about BUDGET seconds: all six side by side, each for as many steps as a
# short probe run says fit the budget. The steps each model ran are in its card's command, so
# `replayssm train` with that command rebuilds it.
#   bash benchmarks/tools/train_models.sh OUT_DIR [BUDGET_S=420 [more replayssm train options]]
# On an 80 GB H100, six side by side need --batch 8 (at 16 the torch fallbacks of transformers'
# chunked recurrences run out of memory). OUT_DIR gets a folder and a .tar per model; the device
# tool returns at most 8 files, so train outside $OUT and bring the tars back:
#   bash benchmarks/tools/train_models.sh /tmp/trained 480 --batch 8; cp /tmp/trained/*.tar $OUT/
# then `tar -xf` each into replayssm/integrations/hf/trained/.
# FLA=DIR (a folder holding the fla-core and flash-linear-attention wheels, carried to the GPU):
# the GDN and KDA models train on flash-linear-attention's kernels, which transformers uses
# where they import (its PyTorch paths loop over chunks in Python: KDA took 1.75 s a step of 8
# windows beside five other runs on an H100), and each folder is then scored again in a process
# without them (`save.rescore`): the cards' figures are those of the PyTorch paths in fp32,
# which a CPU reproduces, not of kernels whose fp32 products may run on TF32 tensor cores.
set -u
OUT=$1; BUDGET=${2:-420}; shift; shift; MORE=("$@"); PROBE=/tmp/train_probe; mkdir -p "$OUT" $PROBE
# six processes share the GPU: segments that grow keep their caching allocators from fragmenting it
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
TRAIN_PATH=${PYTHONPATH:-}
if [ -n "${FLA:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla "$FLA"/*.whl || exit 1
  TRAIN_PATH=/tmp/fla${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
NAMES=(mamba2 gdn kda mamba2:draft gdn:draft kda:draft)
args() { local f=${1%%:*}; echo "--family $f $([ "$1" != "$f" ] && echo --draft)"; }
declare -A NAME=([mamba2]=nemotron-h [gdn]=qwen3-5 [kda]=kimi-linear)
dir() { local f=${1%%:*}; echo "trained-${NAME[$f]}$([ "$1" != "$f" ] && echo -draft)"; }
# the probe: 12 steps each, side by side as the real runs will be (first-step overheads count,
# so the estimate errs long)
for n in "${NAMES[@]}"; do
  PYTHONPATH=$TRAIN_PATH python3 -m replayssm.cli train $(args $n) --out $PROBE/$(dir $n) --steps 12 --warmup 1 \
    --eval-every 1000 --eval-bytes 4097 --no-progress "${MORE[@]}" > $PROBE/$(dir $n).log 2>&1 &
done
wait
declare -A STEPS PATHS
for n in "${NAMES[@]}"; do
  PATHS[$n]=$TRAIN_PATH
  if [ ! -f $PROBE/$(dir $n)/training.json ] && [ -n "${FLA:-}" ]; then
    # flash-linear-attention failed this model: its probe and training without it
    echo "$n: the probe failed with flash-linear-attention, again without it:"; tail -3 $PROBE/$(dir $n).log
    PATHS[$n]=${PYTHONPATH:-}
    PYTHONPATH=${PATHS[$n]} python3 -m replayssm.cli train $(args $n) --out $PROBE/$(dir $n) --steps 12 --warmup 1 \
      --eval-every 1000 --eval-bytes 4097 --no-progress "${MORE[@]}" > $PROBE/$(dir $n).log 2>&1
  fi
  s=$(python3 -c "import json; r = json.load(open('$PROBE/$(dir $n)/training.json')); \
print(int($BUDGET / (r['seconds'] / 12) // 50 * 50))") \
    || { echo "probe of $n failed:"; tail -20 $PROBE/$(dir $n).log; exit 1; }
  STEPS[$n]=$(( s < 50 ? 50 : (s > 4000 ? 4000 : s) )); echo "$n: ${STEPS[$n]} steps"
done
for n in "${NAMES[@]}"; do
  PYTHONPATH=${PATHS[$n]} python3 -m replayssm.cli train $(args $n) --out "$OUT/$(dir $n)" --steps ${STEPS[$n]} \
    --no-progress "${MORE[@]}" > "$OUT/$(dir $n).log" 2>&1 &
done
wait
if [ -n "${FLA:-}" ]; then
  for n in "${NAMES[@]}"; do
    python3 -c "import sys; from replayssm.train import save; r = save.rescore(sys.argv[1], device='cuda'); \
print(sys.argv[1], 'rescored:', r['heldout_bpb'], 'trained with', r['eval']['rescored']['trained_with'])" \
      "$OUT/$(dir $n)" >> "$OUT/$(dir $n).log" 2>&1 &
  done
  wait
fi
for n in "${NAMES[@]}"; do
  tail -2 "$OUT/$(dir $n).log"; cp "$OUT/$(dir $n).log" "$OUT/$(dir $n)/train.log"
  tar -cf "$OUT/$(dir $n).tar" -C "$OUT" "$(dir $n)"
done
