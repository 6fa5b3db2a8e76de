#!/usr/bin/env bash
# On the GPU machine, from the repo root: CUDA kernel tests, then the kernel benchmark.
# Uses the image's python3 (torch + triton preinstalled); logs go to $OUT when set.
set -uo pipefail
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# --confcutdir: skip tests/engine/conftest.py, which needs packages the GPU image lacks
python3 -m pytest tests/engine/kernels -q --confcutdir=tests/engine/kernels -p no:cacheprovider \
    -o addopts="" 2>&1 | tee "$OUT/pytest.log"
echo "pytest rc=${PIPESTATUS[0]}"
python3 ops/bench/bench_kernels.py --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]}"
