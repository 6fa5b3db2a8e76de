#!/usr/bin/env bash
# On the GPU machine, from the repo root (~1.5 minutes on an H200): the stream-K GEMM's CUDA tests
# (bits against the torch reference with real concurrent pieces, rows alone == packed, counters
# left at zero), then the decode sweep at M = 16 and 64 (M="16,64,256,384" adds the few-question
# sizes; BUDGET_S and SWEEP_TIMEOUT bound it) over the 27B linears as the engine
# launches them (stacked inputs): every candidate against the shipped table in the same run,
# inside CUDA graphs over cold weights. Ends with the stream-K / table / other table and the step
# sums. Writes $OUT/pytest_gemm64.log, $OUT/gemm64_sweep.{log,json}; then, on this machine:
#   python3 ops/bench/gemm_table.py gemm64_sweep.json --merge --margin 0.05
set -uo pipefail
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
timeout "${TESTS_S:-60}" python3 -m pytest tests/engine/kernels/test_kernel_int8_gemm.py -q -k "stream or counters" \
    --confcutdir=tests/engine/kernels -p no:cacheprovider -o addopts="" 2>&1 \
    | tee "$OUT/pytest_gemm64.log" | tail -2
timeout "${SWEEP_TIMEOUT:-100}" python3 ops/bench/bench_kernels.py --gemm-only --m "${M:-16,64}" --models 27B \
    --jobs 12 --budget-s "${BUDGET_S:-60}" --out "$OUT/gemm64_sweep.json" 2>&1 \
    | tee "$OUT/gemm64_sweep.log" | grep -v '^\s*$' | sed -n '/^# decode\/prefill/,$p'
