#!/usr/bin/env bash
# On the GPU machine, from the repo root: the forest GDN kernels' CUDA tests, then the per-layer
# GDN microbenchmark (token by token; chunk-64 tensor-core form: fused walk, split walk variants;
# fla last if importable).
#   bash ops/device/gdn_check.sh          # STAGE=tests or STAGE=bench for one half
# Needs the wheels the image lacks in .gpuwheels/ (carry it). Uses GPU 0. Tests ~40 s; the bench
# is cut at BENCH_S seconds (default 150), keeping the rows (and $OUT/gdn.json) it made.
# GDN_PATHS: the bench's --paths (comma-separated rows; token always runs); GDN_OLD: a former
# engine/kernels/forest_gdn.py for --old-module (carry it); GDN_NO_FLA=1: --no-fla.
set -uo pipefail
STAGE=${STAGE:-all}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
if [ "$STAGE" != bench ]; then
    python3 -m pytest tests/engine/kernels/test_kernel_forest_gdn.py -q --confcutdir=tests/engine/kernels \
        -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/pytest_gdn.log" | tail -15
fi
if [ "$STAGE" != tests ]; then
    args=(--out "$OUT/gdn.json")
    [ -n "${GDN_PATHS:-}" ] && args+=(--paths "$GDN_PATHS")
    [ -n "${GDN_OLD:-}" ] && args+=(--old-module "$GDN_OLD")
    [ -n "${GDN_NO_FLA:-}" ] && args+=(--no-fla)
    timeout "${BENCH_S:-150}" python3 ops/bench/bench_gdn.py "${args[@]}" 2>&1 | tee "$OUT/bench_gdn.log"
fi
