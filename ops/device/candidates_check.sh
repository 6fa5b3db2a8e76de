#!/usr/bin/env bash
# On the GPU machine, from the repo root: the candidates session 16 built on the CPU (every one off
# by default and bit-identical to the default by test), their CUDA bit tests and their timings, in
# stages that each fit one 10-minute call:
#   STAGE=tests  bash ops/device/candidates_check.sh   # CUDA bit tests of the candidates (~3 min)
#   STAGE=kernels bash ops/device/candidates_check.sh  # bench_rows SwiGLU + bench_gdn invert split (~6 min)
#   STAGE=engine bash ops/device/candidates_check.sh   # 27B engine A/B of the candidates, one process (~5 min)
# Candidates: forest_attention.CONCURRENT_TIERS (the large-block tiers on a side stream),
# forest_gdn.TC_INVERT_SPLIT (the invert prep in three kernels), decode_quant.RESIDENT_ORDERED /
# RECOMPUTE_ROWS (the SwiGLU quantizer's ordered loads and recompute split), and the host path's
# cuts (in the tree already: `--wall-split` shows them). Carry .gpuwheels and .cache/cutlass.
# Results: $OUT/*.log, *.json (8 files come back at most: the logs first).
set -uo pipefail
STAGE=${STAGE:-tests}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
K=tests/engine/kernels
case "$STAGE" in
tests)
    timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs --confcutdir=$K \
        -k "27b_tiers_beside or swiglu or invert" \
        $K/test_kernel_forest_attention.py $K/test_kernel_decode.py $K/test_kernel_forest_gdn.py \
        2>&1 | tee "$OUT/pytest_candidates.log" | tail -8
    timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs \
        tests/engine/body/test_host_tables.py tests/engine/test_readout.py $K/test_kernel_vocab_mass.py \
        2>&1 | tee "$OUT/pytest_host.log" | tail -4
    ;;
kernels)
    timeout 200 python3 ops/bench/bench_rows.py --kernels swiglu+quant --rows 256,8192,64 --budget-s 150 \
        --out "$OUT/rows-swiglu.json" > "$OUT/rows-swiglu.log" 2>&1
    tail -30 "$OUT/rows-swiglu.log"
    timeout 300 python3 ops/bench/bench_gdn.py --no-fla --out "$OUT/gdn-split.json" \
        --paths "split bf16 inv,split bf16 inv3,split bf16 inv3 wu8" > "$OUT/gdn-split.log" 2>&1
    tail -30 "$OUT/gdn-split.log"
    ;;
engine)
    timeout 560 python3 ops/bench/bench_engine.py --shape 27B --skip-decode --wall-split \
        --variants tc64inv,tc64inv-concurrenttiers,tc64inv-invertsplit --json "$OUT/engine-candidates.json" \
        > "$OUT/engine-candidates.log" 2>&1
    grep -iE "mean|wall|req/s" "$OUT/engine-candidates.log" | tail -30
    ;;
*) echo "STAGE must be tests, kernels or engine"; exit 2 ;;
esac
