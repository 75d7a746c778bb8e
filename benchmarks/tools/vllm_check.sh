#!/bin/bash
# The vLLM plugin's GPU checks (tests/test_vllm_gpu.py -m gpu) on the H200, offline, with the
# bring-up of /work/shared/vllm (README there).
#   before, in earlier calls of the same warm machine: steps A and B of shared/vllm/run_device.sh
#   (c1 -> /tmp/site/vllm; c3 for Qwen3-Next's MoE layer), e.g.
#          bash benchmarks/tools/vllm_check.sh unpack C1_DIR      then, for Qwen3-Next,   ... unpack C3_DIR
#   (c1 and c2 together exceed what one call carries, hence separate calls; with the tree's
#   ~33 MB of trained models beside it c1 itself is too large: split it, `split -b 31M C.so.xz
#   C.so.xz.part-`, the second piece beside fa3.so.xz, one folder and call each, `unpack` each folder)
#   then:  bash benchmarks/tools/vllm_check.sh C2_DIR [pytest args, e.g. -k "nemotron_h_tiny and eager"]
#   or:    bash benchmarks/tools/vllm_check.sh C2_DIR bench [replayssm bench vllm args]   (the serving benchmark)
# C2_DIR: the c2 folder of prep_carry.sh (vllm_src.tar.xz, site312.tar.xz, models/). Each LLM start
# costs 1.5-2 minutes: select a few tests per call (-k), or run them side by side (VLLM_CHECK_PROCS,
# below), to stay inside one command's limit.
set -u
if [ "${1:-}" = unpack ]; then
  D=/tmp/site/vllm; P=/tmp/vllm_parts; mkdir -p $D/vllm_flash_attn $P; X=$2
  # pieces of a file too large to travel beside the tree (`split -b 31M C.so.xz C.so.xz.part-`,
  # each piece in a folder of its own, one call each): gathered in $P until the stream is whole
  for p in $X/*.xz.part-*; do
    [ -f "$p" ] || continue
    cp "$p" $P/; f=$(basename "${p%.part-*}")
    if cat $P/$f.part-* | xz -t 2>/dev/null; then cat $P/$f.part-* > $P/$f && rm $P/$f.part-* && echo "$f: whole"
    else echo "$f: $(ls $P/$f.part-* | wc -l) pieces so far"; fi
  done
  src() { if [ -f $X/$1 ]; then echo $X/$1; elif [ -f $P/$1 ]; then echo $P/$1; fi; }
  s=$(src C.so.xz); [ -n "$s" ] && { xz -T8 -dc $s > $D/_C_stable_libtorch.abi3.so || exit 1; rm -f $P/C.so.xz; }
  s=$(src fa3.so.xz); [ -n "$s" ] && { xz -dc $s > $D/vllm_flash_attn/_vllm_fa3_C.abi3.so || exit 1; rm -f $P/fa3.so.xz; }
  s=$(src moe.so.xz); [ -n "$s" ] && { xz -T8 -dc $s > $D/_moe_C_stable_libtorch.abi3.so || exit 1; rm -f $P/moe.so.xz; }
  ls -la $D; exit 0
fi
# a copied working tree may carry a stale .git: set REPLAYSSM_COMMIT=<the commit> for the results' git_commit
C2=$(cd "$1" && pwd); shift; REPO=$(pwd); T0=$(date +%s); LOG=${OUT:-/tmp}/vllm_check.log
mkdir -p /tmp/site
[ -d /tmp/site/vllm/model_executor ] || for t in vllm_src site312; do tar -xJf $C2/$t.tar.xz -C /tmp/site || exit 1; done
# the entry point as an installed distribution would declare it (replayssm runs from the tree)
EP=/tmp/site/replayssm_vllm_plugin-0.1.0.dist-info; mkdir -p $EP
printf 'Metadata-Version: 2.1\nName: replayssm-vllm-plugin\nVersion: 0.1.0\n' > $EP/METADATA
printf '[vllm.general_plugins]\nreplayssm = replayssm.integrations.vllm:register\n' > $EP/entry_points.txt
export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
  TOKENIZERS_PARALLELISM=false REPLAYSSM_VLLM_MODELS=$C2/models
python3 - <<'PY' || exit 2
import vllm
from importlib.metadata import entry_points
print("vllm", vllm.__version__, "plugins:", [e.value for e in entry_points(group="vllm.general_plugins")])
PY
if [ "${1:-}" = bench ]; then
  shift; python3 -m replayssm.bench.vllm_serving "$@"; rc=$?
  echo "== vllm bench rc=$rc in $(( $(date +%s)-T0 )) s"; exit $rc
fi
# VLLM_CHECK_PROCS=N (N > 1, pytest-xdist importable): the tests in N processes side by side, each
# engine with 0.8/N of the GPU's memory (6 tests x 2 engines fit one 10-minute command this way)
N=${VLLM_CHECK_PROCS:-1}; PAR=()
if [ "$N" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
  PAR=(-n "$N"); export REPLAYSSM_VLLM_CHECK_GPU_MEMORY=$(python3 -c "print(round(0.8 / $N, 3))")
  # vLLM estimates its CUDA graphs' memory from the device's free memory around a trial capture,
  # which counts what the engines beside it allocate meanwhile (one estimate read 37 GiB for a
  # tiny model and left no room for the cache): side by side, the estimate is off
  export VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0
elif [ "$N" -gt 1 ]; then echo "pytest-xdist is not importable: the tests run one after another"; fi
python3 -m pytest tests/test_vllm_gpu.py -m gpu -v -p no:cacheprovider "${PAR[@]}" "$@" 2>&1 | tee $LOG | tail -40
echo "== vllm_check rc=${PIPESTATUS[0]} in $(( $(date +%s)-T0 )) s (log: $LOG)"
