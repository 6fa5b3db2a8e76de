#!/usr/bin/env bash
# On the GPU machine, from the repo root: the one-pass forest body (engine/run/body.py) compiled for
# the first time - its kernels' CUDA tests, graph == eager and batch invariance through
# Engine.decide - then workloads (a)-(d) with the body against the level-by-level executor.
#   STAGE=tests  bash ops/device/body_check.sh     # tests only
#   STAGE=bench  bash ops/device/body_check.sh     # benchmarks only (SHAPES, default "4B 27B";
#                                                  # VARIANTS, default "body,tc,chunk32";
#                                                  # "levels" is the slow torch oracle on CUDA now)
# Needs the wheels the image lacks in .gpuwheels/ (carry it). Uses GPU 0.
set -uo pipefail
STAGE=${STAGE:-all}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
if [ "$STAGE" != bench ]; then
    # --confcutdir keeps pytest off tests/conftest.py (Kafka fixtures need packages the image lacks)
    python3 -m pytest tests/engine/kernels/test_kernel_forest_attention.py \
        tests/engine/kernels/test_kernel_forest_gdn.py tests/engine/kernels/test_kernel_vocab_mass.py \
        tests/engine/kernels/test_kernel_int8_gemm.py -q --confcutdir=tests/engine/kernels \
        -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/pytest_forest_kernels.log" | tail -3
    python3 -m pytest tests/engine/body/test_body.py -q --confcutdir=tests/engine -p no:cacheprovider \
        -o addopts="" -rs 2>&1 | tee "$OUT/pytest_body.log" | tail -5
    python3 -m pytest tests/engine/test_int8_invariance.py -k "cuda" -q --confcutdir=tests/engine \
        -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/pytest_int8.log" | tail -3
fi
if [ "$STAGE" != tests ]; then
    # one process per shape, one weight build: the body, its tensor-core settings (reporting their
    # accuracy against the exact body), and the chunked GDN alone (the level executor, the CPU oracle, is slow torch ops on CUDA)
    for shape in ${SHAPES:-4B 27B}; do  # BENCH_ARGS="--profile $OUT/prof_b.txt" adds (b)'s kernel table
        python3 ops/bench/bench_engine.py --shape "$shape" --variants "${VARIANTS:-body,tc,chunk32}" \
            --json "$OUT/variants_$shape.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/variants_$shape.log" \
            | grep -E '^(---|[a-e]_|accuracy|peak)' | cut -c1-150
    done
fi
