#!/usr/bin/env bash
# On the GPU machine, from the repo root: the thought decoder's CUDA tests (graph == eager,
# batch invariance through Engine.decide, decode kernels), then decode benchmarks.
#   STAGE=tests  bash ops/device/decode_check.sh     # tests only
#   STAGE=bench  bash ops/device/decode_check.sh     # benchmarks only (SHAPES, default "4B 27B")
#   (the bench adds workload (f), thinking requests at 1 and 16 concurrent; THINKING=0 skips it)
# Needs the wheels the image lacks in .gpuwheels/ (carry it). Uses GPU 0.
set -uo pipefail
STAGE=${STAGE:-all}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
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
            $([ "${THINKING:-1}" = 0 ] || echo --thinking) ${BENCH_ARGS:-} 2>&1 | tee "$OUT/decode_$shape.log" | grep -v '^\s*$' | tail -6
    done
fi
