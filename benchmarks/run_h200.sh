#!/usr/bin/env bash
# The GPU check in one command: the GPU tests at real shapes, the 16K-step record-precision
# study and the decode benchmark behind docs/kernels.md's table (window 16, bf16 records and token
# inputs, staggered and lock-step rows). Under 10 minutes on an H200. Run from the repository
# root on the GPU machine:
#   OUT=/some/dir STAGE=all bash benchmarks/run_h200.sh
# STAGE: all (test, records, bench) | test | records | bench | windows (the by-window table:
# windows 8 and 32, window 16 with fp32 records and with fp32 token inputs; about 6 minutes)
# | verify (the speculative-verification benchmark: replay and snapshot against one
# conventional step, batch 64, 256 and 512, T = 1, 2, 4, 6, 8, windows 16 and L*, drafts all
# rejected and all accepted; then T = 4 at every acceptance length) | verify-variants
# (the verify kernels' candidate launch configs at batch 256, drafts all rejected and all
# accepted, to choose their defaults) | model (the whole-model decode benchmark) | precision
# (the separate-precision kernel benchmark and the layer-level error study to 131072 tokens)
# | precision-long (the NVFP4 designs of the error study to 131072 tokens, then the model-level
# study) | vllm-ssu (vLLM's Mamba-2 decode kernel beside ours; VLLM_SRC: a folder holding vLLM 0.25.0's
# unzipped `vllm/` sources, carried to the GPU machine) | fork (the public ReplaySSM fork's verify
# kernels beside ours, batch 256, T = 2, 4, 8, every acceptance count, then their accuracy
# against the float64 reference; FORK_SRC: a checkout of the fork holding the files of
# replayssm.bench.peers.fork.FORK_FILES, carried to the GPU machine) | switches (the experimental
# switches' GPU tests, then each timed beside the default; TESTS_ONLY=1 / BENCH_ONLY=1: one half).
# Results go to $OUT (default ./gpu-check/, under the names benchmarks/results/README.md lists;
# copy the ones to keep into benchmarks/results/). PYTHON: the interpreter (default: ./.venv's
# where run.sh made one, else python3). The exit status is 1 when any step failed.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-gpu-check}"
STAGE="${STAGE:-all}"
mkdir -p "$OUT"
# every `python3` below is this interpreter
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || command -v python3)}"
python3() { "$PYTHON" "$@"; }
# a failing step is reported and the run goes on to the next; the exit status says it failed
FAILED=0
trap 'rc=$?; FAILED=1; echo "run_h200.sh: line $LINENO failed (status $rc): ${BASH_COMMAND:0:160}" >&2' ERR
trap 'exit $FAILED' EXIT
# pytest-timeout is not in the test extra: its limit only where it is installed
TIMEOUT=(); python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT=(--timeout 400)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
decode() {  # decode <name> <args...>: the decode benchmark, JSON, plot and log under $OUT/<name>
  local name="$1"; shift
  python3 -m replayssm.bench.decode --reps 6 "$@" --out "$OUT/$name.json" 2>&1 \
    | tee "$OUT/$name.log" | grep -v " L=" | tail -35
}
if [[ "$STAGE" == all || "$STAGE" == test ]]; then
  # TESTS: a subset, e.g. TESTS="tests/test_conventional_lp.py tests/test_precision_kernels.py";
  # the whole set took 8 min 15 s with 12 pytest-xdist workers (the compiles are the CPU's)
  python3 -m pytest -m gpu ${TESTS:-tests} -n "${WORKERS:-12}" -v -p no:cacheprovider ${TIMEOUT[@]+"${TIMEOUT[@]}"} 2>&1 \
    | tee "$OUT/gpu_tests_h200.log" | tail -5
fi
if [[ "$STAGE" == all || "$STAGE" == records ]]; then
  python3 -m replayssm.bench.records --steps 16384 --out "$OUT/records_h200.json" 2>&1 | tail -14
fi
if [[ "$STAGE" == all || "$STAGE" == bench ]]; then
  decode decode_h200_w16 --windows 16 --cursors staggered,lockstep
fi
if [[ "$STAGE" == windows ]]; then
  decode decode_h200_w8_w32 --windows 8,32 --cursors staggered,lockstep
  decode decode_h200_w16_fp32_records --windows 16 --cursors staggered --record-dtype float32
  decode decode_h200_w16_fp32_inputs --windows 16 --cursors staggered --input-dtype float32
fi
if [[ "$STAGE" == verify ]]; then
  python3 -m replayssm.bench.verify --batches 64,256,512 --drafts 1,2,4,6,8 --windows 16,star --accepted ends --reps 6 --out "$OUT/verify_h200.json" 2>&1 | tee "$OUT/verify_h200.log" | tail -34
  # every acceptance length at T = 4: the time per accepted token at mean acceptance 3
  python3 -m replayssm.bench.verify --batches 256,512 --drafts 4 --accepted all --reps 6 --out "$OUT/verify_h200_t4_all.json" 2>&1 | tail -14
fi
if [[ "$STAGE" == verify-variants ]]; then
  v() { python3 -m replayssm.bench.verify --batches 256 --accepted ends --no-snapshot "$@" 2>&1 | grep -E "variant|x$" | tail -40; }
  v --shapes nemotron3-super --out "$OUT/verify_variants_super.json" \
    --variants '[{"BV": 64, "num_warps": 2}, {"BV": 64, "num_warps": 4}, {"BV": 32, "num_warps": 2}, {"BV": 32, "num_warps": 4}]'
  v --shapes nemotron3-nano-4b --out "$OUT/verify_variants_nano4b.json" \
    --variants '[{"BV": 16, "num_warps": 1}, {"BV": 16, "num_warps": 2}]'
  v --shapes qwen3.5-4b,kimi-linear-48b --out "$OUT/verify_variants_delta.json" \
    --variants '[{"KS": 4}, {"KS": 16}, {"BV": 64, "num_warps": 8}, {"BV": 16, "num_warps": 1}]'
fi
if [[ "$STAGE" == vllm-ssu ]]; then
  python3 benchmarks/tools/vllm_ssu.py --vllm-src "${VLLM_SRC:?VLLM_SRC: the unzipped vLLM sources}" \
    --out "$OUT/vllm_ssu_h200.json" 2>&1 | grep -v -i "warning\|config file" | tail -20
fi
if [[ "$STAGE" == fork ]]; then
  FORK="${FORK_SRC:?FORK_SRC: a checkout of the public ReplaySSM fork}"
  python3 -m replayssm.bench.verify --shapes nemotron3-super,nemotron3-nano-4b,qwen3.5-4b,qwen3.5-122b \
    --batches 256 --drafts 2,4,8 --no-snapshot --fork-src "$FORK" --out "$OUT/verify_fork_h200.json" 2>&1 \
    | tee "$OUT/verify_fork_h200.log" | tail -16
  python3 benchmarks/tools/fork_verify.py --fork-src "$FORK" --check-only --drafts 2,4,8 \
    --out "$OUT/fork_accuracy_h200.json" 2>&1 | tail -14
fi
if [[ "$STAGE" == switches ]]; then
  # The experimental switches (docs/kernels.md's table): their GPU tests, then each timed as a
  # variant beside the default, interleaved in one process (replayssm.bench.switches), with the
  # fork's verify beside when FORK_SRC is set. About 8 minutes on an H100 with TESTS_ONLY unset.
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]00' | tr 'H' 'h')
  if [[ -z "${BENCH_ONLY:-}" ]]; then
    python3 -m pytest -m gpu -n "${WORKERS:-12}" -q -p no:cacheprovider ${TIMEOUT[@]+"${TIMEOUT[@]}"} \
      tests/test_verify_gluon_gdn.py tests/test_verify_gluon_mamba2.py tests/test_gluon_lowp.py \
      tests/test_gluon_lowp_gdn.py tests/test_verify_lp.py tests/test_verify_lp_switches.py -k "gluon_lean \
      or keys_global or read_mma or heads or split_gpu_rows or lp_gluon_gdn_real or lp_gluon_kda_real \
      or bf16_records or decode_bit_exact" 2>&1 | tee "$OUT/switch_tests_$card.log" | tail -8
  fi
  if [[ -n "${TESTS_ONLY:-}" ]]; then exit; fi
  vs() { python3 -m replayssm.bench.verify --batches 256 --drafts 8 --accepted ends --no-snapshot --reps 6 \
    ${FORK_SRC:+--fork-src "$FORK_SRC"} "$@" 2>&1 | tail -24; }
  vs --shapes nemotron3-super,nemotron3-nano-4b --out "$OUT/verify_switches_mamba2_$card.json" \
    --variants '[{"switches": {"mamba2_verify_keys_global": true}}]'
  vs --shapes qwen3.5-4b,qwen3.5-122b --out "$OUT/verify_switches_gdn_$card.json" \
    --variants '[{"switches": {"gdn_verify_lean": true}}, {"switches": {"gdn_verify_lean": true, "gdn_verify_rows": 2}}]'
  vs --shapes qwen3.5-4b,qwen3.5-122b,kimi-linear-48b --out "$OUT/verify_switches_lp_$card.json" \
    --variants '[{"lp": "fp16"}, {"lp": "fp16", "switches": {"lp_refold_mma": true}}, {"lp": "fp16", "switches": {"lp_kda": true}}]'
  python3 -m replayssm.bench.precision --shapes nemotron3-super,nemotron3-nano-4b,qwen3.5-4b --batches 256 \
    --no-window --formats fp16,fp8_e4m3,nvfp4 --reps 10 --out "$OUT/precision_switches_$card.json" \
    --configs '[{"switches": {"lp_read_mma": true}}, {"switches": {"lp_rows": 2}}, {"switches": {"lp_heads": 2}}, {"switches": {"lp_heads": 2, "lp_read_mma": true}}]' \
    2>&1 | tail -40
  # each variant's time over the default's, per shape (below 1: faster)
  python3 -m replayssm.bench.switches "$OUT"/verify_switches_*_"$card".json "$OUT/precision_switches_$card.json"
fi
if [[ "$STAGE" == model ]]; then
  python3 -m replayssm.bench.model --out "$OUT/model_h200.json" 2>&1 | tee "$OUT/model_h200.log" | tail -20
fi
if [[ "$STAGE" == precision-configs ]]; then
  # the precision kernels' candidate launch configs (non-flush steps, batch 256), to choose their defaults
  pc() { python3 -m replayssm.bench.precision --batches 256 --no-window --reps 10 "$@" 2>&1 | tail -60; }
  pc --shapes nemotron3-super,nemotron3-nano-4b --out "$OUT/precision_configs_mamba2_h200.json" \
    --configs '[{"BV":64,"num_warps":2},{"BV":64,"num_warps":4},{"BV":64,"num_warps":8},{"BV":32,"num_warps":2},{"BV":32,"num_warps":4},{"BV":16,"num_warps":2}]'
  pc --shapes qwen3.5-4b,kimi-linear-48b --out "$OUT/precision_configs_delta_h200.json" \
    --configs '[{"BV":128,"num_warps":4},{"BV":128,"num_warps":8},{"BV":64,"num_warps":2},{"BV":64,"num_warps":4},{"BV":64,"num_warps":8},{"BV":32,"num_warps":2}]'
fi
if [[ "$STAGE" == precision ]]; then
  python3 -m replayssm.bench.precision --out "$OUT/precision_h200.json" 2>&1 | tee "$OUT/precision_h200.log" | tail -30
  python3 -m replayssm.cli study precision --engine batched --device cuda --tokens 131072 \
    --out "$OUT/precision_study_h200.json" 2>&1 | tee "$OUT/precision_study_h200.log" | tail -30
fi
if [[ "$STAGE" == precision-long ]]; then
  # the NVFP4 designs alone (4 of the study's 21 variants), so that each shape can reach 131072
  # tokens inside one command (all 21 reached 63,744 and 90,368 in 200 s a shape); then the
  # model-level study on the GPU
  python3 -m replayssm.cli study precision --engine batched --device cuda --tokens 131072 --formats nvfp4 \
    --designs shared,separate,separate-fp8sr --time-budget 250 \
    --out "$OUT/precision_study_nvfp4_h200.json" 2>&1 | tee "$OUT/precision_study_nvfp4_h200.log" | tail -14
  # (the 4B models, random weights, eager forwards at batch 1: at 45 s a model the reference
  # reached 16 steps, so the model-level results are the tiny models' on the CPU, docs/precision.md)
  python3 -m replayssm.cli study precision-model --models nemotron3-nano-4b,qwen3.5-4b --device cuda \
    --time-budget 120 --out "$OUT/precision_model_h200.json" 2>&1 | tee "$OUT/precision_model_h200.log" | tail -30
fi
