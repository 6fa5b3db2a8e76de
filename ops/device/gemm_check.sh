#!/usr/bin/env bash
# On the GPU machine, from the repo root: the int8 GEMM's CUDA tests (every config bit-equal to
# the torch reference, rows alone == packed), then the GEMM config sweep at the 27B and 4B
# shapes (~4 minutes: bench_kernels.py --gemm-only; --budget-s bounds the candidate part).
#   bash ops/device/gemm_check.sh                  # tests + sweep
#   STAGE=bench bash ops/device/gemm_check.sh      # sweep only (SWEEP_ARGS="--models 27B" etc.)
# Writes $OUT/pytest_gemm.log, $OUT/gemm_preflight.log, $OUT/gemm_sweep.{log,json} and
# $OUT/decode_attention.{log,json}. Uses GPU 0.
set -uo pipefail
STAGE=${STAGE:-all}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
if [ "$STAGE" != bench ]; then
    python3 -m pytest tests/engine/kernels/test_kernel_int8_gemm.py -q --confcutdir=tests/engine/kernels \
        -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/pytest_gemm.log" | tail -3
fi
if [ "$STAGE" != tests ]; then
    # every candidate once in its own process first: a warp-specialized config that hangs or
    # faults is dropped from the sweep instead of stalling it (compiles land in Triton's cache)
    if ! timeout 100 python3 ops/bench/bench_kernels.py --preflight > "$OUT/gemm_preflight.log" 2>&1; then
        echo "preflight failed (see gemm_preflight.log): sweeping without warp-specialized configs"
        SWEEP_ARGS="--skip-ws ${SWEEP_ARGS:-}"
    fi
    grep -c bit-equal "$OUT/gemm_preflight.log" | sed 's/^/preflight bit-equal configs: /'
    # the sweep rewrites $OUT/gemm_sweep.json.partial after each linear: a cut-short run keeps its rows
    timeout "${SWEEP_TIMEOUT:-330}" python3 ops/bench/bench_kernels.py --gemm-only --out "$OUT/gemm_sweep.json" \
        ${SWEEP_ARGS:-} 2>&1 \
        | tee "$OUT/gemm_sweep.log" | grep -v '^\s*$' | tail -40
    # decode attention: one pass against the prefix split, 1-64 rows, 512-8,192 keys (~20 s)
    timeout 100 python3 ops/bench/bench_kernels.py --attention --out "$OUT/decode_attention.json" 2>&1 \
        | tee "$OUT/decode_attention.log" | grep "decode attention"
fi
