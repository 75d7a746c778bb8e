#!/bin/bash
# The model-level precision study (`replayssm study precision-model`) of trained models with its
# variants spread over processes side by side on one GPU: a teacher-forced pass of a tiny model
# is launch-bound (one CUDA-graph replay a token), so processes overlap where one pass would
# leave the GPU idle. Each process runs the fp32 reference and its share of the variants over
# the same held-out bytes; the parts are merged into one document, table and plot.
#   bash benchmarks/tools/precision_model_parallel.sh OUT.json BUDGET_S MODEL[,MODEL...] [more study options]
# BUDGET_S is each process's --time-budget: its reference pass gets a share, and every variant
# runs the steps the reference reached (the rows' token counts say how far each part got). Each
# pass's first step (kernel compiles, graph capture) comes on top: with ten processes side by
# side on a 16-core H100 host a pass of 64-128 tokens took 15-24 s, mostly that.
set -u
OUT=$1; BUDGET=$2; IFS=, read -ra MODELS <<< "$3"; shift 3; MORE=("$@")
PARTS=/tmp/pms_parts; rm -rf $PARTS; mkdir -p $PARTS
# designs and formats per process: the paper's comparison (separate reads of an fp32
# recurrence, one shared low-precision checkpoint, a conventional 16-bit state)
SPLITS=("separate fp8_e4m3,nvfp4" "shared fp8_e4m3" "shared nvfp4" "conventional-lowp bf16" "conventional-lowp fp16")
files=()
for m in "${MODELS[@]}"; do
  for i in "${!SPLITS[@]}"; do
    read -r d f <<< "${SPLITS[$i]}"; part=$PARTS/$m-$i.json; files+=("$part")
    python3 -m replayssm.cli study precision-model --models "$m" --designs "$d" --formats "$f" \
      --time-budget "$BUDGET" --out "$part" --no-plot "${MORE[@]}" > "$PARTS/$m-$i.log" 2>&1 &
  done
done
wait
for f in $PARTS/*.log; do echo "== $f"; grep -v "^ " "$f" | tail -4; done
python3 -m replayssm.cli study precision-model --merge "${files[@]}" --out "$OUT"
