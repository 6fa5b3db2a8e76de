#!/usr/bin/env bash
# On the GPU machine, from the repo root: the forest GDN kernels' CUDA tests, then the per-layer
# GDN microbenchmark (token by token; chunk-64 tensor-core form: fused walk, split walk variants;
# fla last if importable).
#   bash ops/device/gdn_check.sh          # STAGE=tests or STAGE=bench for one half
# Needs the wheels the image lacks in .gpuwheels/ (carry it). Uses GPU 0. Tests ~40 s; the bench
# is cut at BENCH_S seconds (default 150), keeping the rows (and $OUT/gdn.json) it made.
set -uo pipefail
STAGE=${STAGE:-all}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
if [ "$STAGE" != bench ]; then
    python3 -m pytest tests/engine/kernels/test_kernel_forest_gdn.py -q --confcutdir=tests/engine/kernels \
        -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/pytest_gdn.log" | tail -15
fi
if [ "$STAGE" != tests ]; then
    timeout "${BENCH_S:-150}" python3 ops/bench/bench_gdn.py --out "$OUT/gdn.json" 2>&1 | tee "$OUT/bench_gdn.log"
fi
