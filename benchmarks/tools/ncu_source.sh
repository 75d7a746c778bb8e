#!/usr/bin/env bash
# Source-level Nsight Compute profile of one decode kernel (full section set, one launch):
# the report, a per-SASS-instruction CSV (executed instructions, stall samples, mapped to the
# kernel's Python lines; benchmarks/tools/sass_stalls.py sums it) and the details page, plus
# the Triton IR of every kernel compiled (in $TRITON_CACHE_DIR).
# Gluon kernels: KREGEX=_gluon_replay_kernel (Mamba-2) or KREGEX=_gluon_gdn_kernel.
# Run on the GPU machine from the repository root:
#   OUT=/some/dir bash benchmarks/tools/ncu_source.sh qwen3.5-4b 256 replay ['{"ablate": 3}' [tag]]
# The optional fourth argument is a replay config (JSON, passed to profile_decode.py), the
# fifth a suffix for the output files' names.
# KREGEX overrides the kernel-name regex (default `_<kind>_decode_kernel`; GDN's materialising
# kernel is `_replay_decode_mat_kernel`); REP is where the .ncu-rep goes (default $OUT).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp}"
shape="$1"; batch="$2"; kind="${3:-replay}"
cfg="${4:-null}"
tag="${shape}_${batch}_${kind}${5:+_$5}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton_cache_ncu}"
REP="${REP:-$OUT}"
ncu --clock-control none -k "regex:${KREGEX:-_${kind}_decode_kernel}" --launch-skip 16 --launch-count 1 \
    --set full --import-source yes -f -o "$REP/ncu_$tag" \
    python3 benchmarks/tools/profile_decode.py "$shape" "$batch" "$cfg" > "$OUT/ncu_${tag}_run.txt" 2>&1
ncu -i "$REP/ncu_$tag.ncu-rep" --page details > "$OUT/ncu_${tag}_details.txt" 2>&1
ncu -i "$REP/ncu_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${tag}_sass.csv" 2>&1
grep -E "Duration|Registers Per|Achieved Occupancy|DRAM Throughput|L1/TEX Cache|Executed Ipc|Issue Slots Busy" \
    "$OUT/ncu_${tag}_details.txt" | head -12
