#!/bin/bash
# Trains the shipped models (replayssm/integrations/hf/trained/: a main model and a draft per
# family) on one GPU in about BUDGET seconds: all six side by side, each for as many steps as a
# short probe run says fit the budget. The steps each model ran are in its card's command, so
# `replayssm train` with that command rebuilds it.
#   bash benchmarks/tools/train_models.sh OUT_DIR [BUDGET_S=420 [more replayssm train options]]
# On an 80 GB H100, six side by side need --batch 8 (at 16 the torch fallbacks of transformers'
# chunked recurrences run out of memory). OUT_DIR gets a folder per model, and TARS (default
# OUT_DIR) a .tar of each as soon as that model is done, so a run cut short keeps the models it
# finished; the device tool returns at most 8 files, so train outside $OUT and tar into it:
#   TARS=$OUT bash benchmarks/tools/train_models.sh /tmp/trained 300 --batch 8
# then `tar -xf` each into replayssm/integrations/hf/trained/. The whole run takes about the
# budget plus 2 minutes (probe, final held-out scoring, saving).
# FLA=DIR (a folder holding the fla-core and flash-linear-attention wheels, carried to the GPU):
# the GDN and KDA models train on flash-linear-attention's kernels, which transformers uses
# where they import (its PyTorch paths loop over chunks in Python: KDA took 1.75 s a step of 8
# windows beside five other runs on an H100), and each folder is then scored again in a process
# without them (`save.rescore`): the cards' figures are those of the PyTorch paths in fp32,
# which a CPU reproduces, not of kernels whose fp32 products may run on TF32 tensor cores.
set -u
OUT=$1; BUDGET=${2:-420}; shift; shift; MORE=("$@"); PROBE=/tmp/train_probe; TARS=${TARS:-$OUT}
mkdir -p "$OUT" "$TARS" $PROBE
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
    # flash-linear-attention failed this model (its GDN refuses Hopper under Triton < 3.7.1):
    # probe again without it, all such models side by side as they will train
    echo "$n: the probe failed with flash-linear-attention, again without it:"; tail -2 $PROBE/$(dir $n).log
    PATHS[$n]=${PYTHONPATH:-}
    PYTHONPATH=${PATHS[$n]} python3 -m replayssm.cli train $(args $n) --out $PROBE/$(dir $n) --steps 12 --warmup 1 \
      --eval-every 1000 --eval-bytes 4097 --no-progress "${MORE[@]}" > $PROBE/$(dir $n).log 2>&1 &
  fi
done
wait
for n in "${NAMES[@]}"; do
  # 0.8: a probe run with fewer neighbours steps faster than the six together will
  s=$(python3 -c "import json; r = json.load(open('$PROBE/$(dir $n)/training.json')); \
print(int(0.8 * $BUDGET / (r['seconds'] / 12) // 50 * 50))") \
    || { echo "probe of $n failed:"; tail -20 $PROBE/$(dir $n).log; exit 1; }
  STEPS[$n]=$(( s < 50 ? 50 : (s > 4000 ? 4000 : s) )); echo "$n: ${STEPS[$n]} steps"
done
one() {   # train, rescore where trained on flash-linear-attention, tar: one model, start to end
  local n=$1 d; d=$(dir $1)
  PYTHONPATH=${PATHS[$n]} python3 -m replayssm.cli train $(args $n) --out "$OUT/$d" --steps ${STEPS[$n]} \
    --eval-every 100000 --no-progress "${MORE[@]}" > "$OUT/$d.log" 2>&1 || { tail -5 "$OUT/$d.log"; return 1; }
  if [ "${PATHS[$n]}" != "${PYTHONPATH:-}" ]; then
    python3 -c "import sys; from replayssm.train import save; r = save.rescore(sys.argv[1], device='cuda'); \
print(sys.argv[1], 'rescored:', r['heldout_bpb'], 'trained with', r['eval']['rescored']['trained_with'])" \
      "$OUT/$d" >> "$OUT/$d.log" 2>&1
  fi
  tail -2 "$OUT/$d.log"; cp "$OUT/$d.log" "$OUT/$d/train.log"
  tar -cf "$TARS/$d.tar" -C "$OUT" "$d"
}
for n in "${NAMES[@]}"; do one $n & done
wait
