#!/usr/bin/env bash
# On the GPU machine, from the repo root: the row kernels' and the forest conv's CUDA tests
# (against the torch references; resident == long-row kernels and every conv tiling == the
# default, bit for bit; the conv == the decode conv step), then bench_rows.py (each kernel's
# default and its other configs in one run, every variant's bits checked, a table at the end).
#   bash ops/device/rows_check.sh          # STAGE=tests or STAGE=bench for one half
# Needs the wheels the image lacks in .gpuwheels/ (carry it). Uses GPU 0. Tests are cut at
# TESTS_S seconds (default 60); the bench starts no new size after BENCH_S (default 25) and is
# killed at BENCH_S + 25 (all in <= 120 s), keeping $OUT/rows.json.
set -uo pipefail
STAGE=${STAGE:-all}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
if [ "$STAGE" != bench ]; then
    timeout "${TESTS_S:-60}" python3 -m pytest -q -m "not slow" -k "quant or norm or swiglu or conv" \
        tests/engine/kernels/test_kernel_quant.py tests/engine/kernels/test_kernel_norm.py \
        tests/engine/kernels/test_kernel_decode.py tests/engine/kernels/test_kernel_forest_gdn.py \
        --confcutdir=tests/engine/kernels -p no:cacheprovider -o addopts="" 2>&1 \
        | tee "$OUT/pytest_rows.log" | tail -8
fi
if [ "$STAGE" != tests ]; then
    B=${BENCH_S:-25}
    timeout $((B + 25)) python3 ops/bench/bench_rows.py --quick --budget-s "$B" --out "$OUT/rows.json" 2>&1 \
        | tee "$OUT/bench_rows.log"
fi
