#!/usr/bin/env bash
# On the GPU machine, from the repo root: CUDA tests of the int8 path and kernels, then the
# engine benchmark at 4B/9B/27B shapes. Needs the wheels the image lacks in .gpuwheels/ (carry it).
set -uo pipefail
source ops/device/setup.sh
# --confcutdir keeps pytest off tests/conftest.py (Kafka fixtures need packages the image lacks)
python3 -m pytest tests/engine/kernels -q --confcutdir=tests/engine/kernels -p no:cacheprovider -o addopts="" \
    2>&1 | tee "$OUT/pytest_kernels.log" | tail -3
python3 -m pytest tests/engine/test_quant.py tests/engine/test_int8_invariance.py -k cuda -q \
    --confcutdir=tests/engine -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/pytest_int8.log" | tail -5
for shape in ${SHAPES:-4B 9B 27B}; do
    python3 ops/bench/bench_engine.py --shape "$shape" --json "$OUT/bench_$shape.json" ${BENCH_ARGS:-} \
        2>&1 | tee "$OUT/bench_$shape.log" | tail -12
done
