#!/usr/bin/env bash
# On the GPU machine, from the repo root: every kernel part's CUDA tests and its old-vs-new
# benchmark in one call (<= ~540 s), each cut at its own time limit so one slow part cannot take
# the others' time. Parts (PARTS, default all, in this order):
#   rows  - row kernels and the forest conv (ops/device/rows_check.sh)
#   gdn   - the chunk-64 GDN prep forms (test_kernel_forest_gdn.py tc cases, bench_gdn.py)
#   attn  - forest attention's ancestor split (test_kernel_forest_attention.py, bench_attention.py)
#   gemm  - the stream-K GEMM tests and the sweep at M (default 16,64,256,384; gemm64_check.sh)
# Each part writes under $OUT/<part>/; at the end everything is packed into $OUT/parts.tgz (the
# device tool brings back at most 8 files). Needs .gpuwheels (carry it). Uses GPU 0.
set -uo pipefail
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
ROOT_OUT=${OUT:-/tmp/gpu_out}
source ops/device/setup.sh
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs --confcutdir=tests/engine/kernels)
for part in ${PARTS:-rows gdn attn gemm}; do
    export OUT="$ROOT_OUT/$part"
    mkdir -p "$OUT"
    echo "=== $part ($(date -u +%T))"
    case $part in
        rows) bash ops/device/rows_check.sh 2>&1 | grep -v "^WARNING: Target directory" | tail -40 ;;
        gdn)
            timeout 45 "${PYTEST[@]}" tests/engine/kernels/test_kernel_forest_gdn.py -x -k "tc_ or chunk_options" \
                > "$OUT/pytest_gdn.log" 2>&1; tail -3 "$OUT/pytest_gdn.log"
            timeout 75 python3 ops/bench/bench_gdn.py --no-fla --reps 30 \
                --paths "token,split bf16,split bf16 inv,split bf16 inv w8" --out "$OUT/gdn.json" \
                > "$OUT/bench_gdn.log" 2>&1; tail -14 "$OUT/bench_gdn.log" ;;
        attn)
            timeout 45 "${PYTEST[@]}" tests/engine/kernels/test_kernel_forest_attention.py \
                -k "split or (27b and bf16) or wide or narrow" > "$OUT/pytest_attn.log" 2>&1
            tail -3 "$OUT/pytest_attn.log"
            timeout 75 python3 ops/bench/bench_attention.py --reps 10 --split-only --split-sweep \
                --workload q8k --workload cq --workload b --workload a --out "$OUT/attn_split.json" \
                > "$OUT/attn_split.log" 2>&1; tail -16 "$OUT/attn_split.log" ;;
        gemm) M=${M:-16,64,256,384} BUDGET_S=${BUDGET_S:-90} SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-130} TESTS_S=40 \
            bash ops/device/gemm64_check.sh 2>&1 | grep -v "^WARNING: Target directory" | tail -45 ;;
        *) echo "unknown part $part" ;;
    esac
done
cd "$ROOT_OUT" && tar czf parts.tgz --exclude=parts.tgz ./* && find . -mindepth 1 -not -name parts.tgz -delete
ls -la "$ROOT_OUT"
