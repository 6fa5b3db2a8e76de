#!/usr/bin/env bash
# On the GPU machine, from the repo root: the thought decoder's CUDA tests (graph == eager,
# batch invariance through Engine.decide, decode kernels), then decode benchmarks.
#   STAGE=tests  bash ops/device/decode_check.sh     # tests only
#   STAGE=bench  bash ops/device/decode_check.sh     # benchmarks only (SHAPES, default "4B 27B")
# Needs the wheels the image lacks in .gpuwheels/ (carry it). Uses GPU 0.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
STAGE=${STAGE:-all}
mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpuwheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader -i 0
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log -1 --format='commit %H' 2>/dev/null || true
if [ "$STAGE" != bench ]; then
    # --confcutdir keeps pytest off tests/conftest.py (Kafka fixtures need packages the image lacks)
    python3 -m pytest tests/engine/kernels/test_kernel_decode.py -q --confcutdir=tests/engine/kernels \
        -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/pytest_decode_kernels.log" | tail -3
    python3 -m pytest tests/engine/decode -q --confcutdir=tests/engine -p no:cacheprovider -o addopts="" -rs \
        2>&1 | tee "$OUT/pytest_decoder.log" | tail -5
    python3 -m pytest tests/engine/test_int8_invariance.py -k cuda -q --confcutdir=tests/engine \
        -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/pytest_int8.log" | tail -3
fi
if [ "$STAGE" != tests ]; then
    for shape in ${SHAPES:-4B 27B}; do  # BENCH_ARGS="--decode-profile $OUT/prof" adds a per-kernel profile
        python3 ops/bench/bench_engine.py --shape "$shape" --decode-only --json "$OUT/decode_$shape.json" \
            ${BENCH_ARGS:-} 2>&1 | tee "$OUT/decode_$shape.log" | grep -v '^\s*$' | tail -6
    done
fi
