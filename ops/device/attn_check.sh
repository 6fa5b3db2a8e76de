#!/usr/bin/env bash
# On the GPU machine, from the repo root: forest attention's CUDA tests (the tiny shapes compiled
# through every kernel and config under test, the 27B head shape alone == packed, within the
# rounding bound and bit-equal where promised: the tiers, q16, the short split, PIECE_ALIGN),
# then the attention bench (every setting in a CUDA graph, old vs new, 27B and 4B heads).
#   STAGE=tests|bench|all bash ops/device/attn_check.sh [bench_attention.py args, e.g. --quick]
# Needs the wheels the image lacks in .gpuwheels/ (carry it). Uses GPU 0. tests ~2-3 minutes
# (most of it compiling), bench ~2-3 (--heads 27B: ~1.5).
set -uo pipefail
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
STAGE=${STAGE:-all}
source ops/device/setup.sh
if [ "$STAGE" = tests ] || [ "$STAGE" = all ]; then
    python3 -m pytest tests/engine/kernels/test_kernel_forest_attention.py -q --confcutdir=tests/engine/kernels \
        -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/pytest_attention.log" | tail -8
    echo "pytest rc=${PIPESTATUS[0]}"
fi
if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then
    python3 ops/bench/bench_attention.py --out "$OUT/attention.json" "$@" 2>&1 | tee "$OUT/attention.log"
    echo "bench rc=${PIPESTATUS[0]}"
fi
