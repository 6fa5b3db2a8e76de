#!/usr/bin/env bash
# On the GPU machine, from the repo root: forest attention's CUDA tests (tiny shapes through both
# kernels, the 27B head shape alone == packed and within the rounding bound), then the attention
# microbenchmark (16-row kernel vs the large-block one, 27B layer shape, workloads a/b/c).
#   bash ops/device/attn_check.sh [bench_attention.py args, e.g. --no-sweep]
# Needs the wheels the image lacks in .gpuwheels/ (carry it). Uses GPU 0. ~1-2 minutes.
set -uo pipefail
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
python3 -m pytest tests/engine/kernels/test_kernel_forest_attention.py -q --confcutdir=tests/engine/kernels \
    -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/pytest_attention.log" | tail -5
echo "pytest rc=${PIPESTATUS[0]}"
python3 ops/bench/bench_attention.py --out "$OUT/attention.json" "$@" 2>&1 | tee "$OUT/attention.log"
echo "bench rc=${PIPESTATUS[0]}"
