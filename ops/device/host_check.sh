#!/usr/bin/env bash
# On the GPU machine, from the repo root: the host side of the one-pass body and the read-out
# (engine/run/body.py HOST_TABLES "packed" against "lists", engine/decide/readout.py DEVICE_READS
# "batched" against "per_row"), ~3 minutes at 27B:
#   1. their CUDA tests (~20 s): packed tables == lists tables on a CUDA body, the device RoPE
#      table == rope_rows, batched device read-outs == row by row;
#   2. bench_host.py --device cuda (~40 s): per-stage host ms of both forms, uploads synced, and
#      the wall a read-out adds behind a pass;
#   3. bench_engine.py --wall-split on 27B random weights (~2 min: weights, (a)-(d), captures):
#      a/b_wall_split (new) and a/b_wall_split_lists (old) on the same graphs.
#   STAGE=tests|host|engine bash ops/device/host_check.sh    # one part only
# Needs .gpuwheels (carry it). Uses GPU 0. Writes $OUT/host.json, $OUT/engine.json and logs.
set -uo pipefail
STAGE=${STAGE:-all}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
    timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs --confcutdir=tests/engine \
        tests/engine/body/test_host_tables.py tests/engine/test_rope.py \
        tests/engine/kernels/test_kernel_vocab_mass.py > "$OUT/pytest_host.log" 2>&1
    tail -3 "$OUT/pytest_host.log"
fi
if [ "$STAGE" = all ] || [ "$STAGE" = host ]; then
    (cd ops/bench && timeout 150 python3 bench_host.py --shape 27B --device cuda --json "$OUT/host.json") \
        2>&1 | tee "$OUT/bench_host.log"
fi
if [ "$STAGE" = all ] || [ "$STAGE" = engine ]; then
    timeout 300 python3 ops/bench/bench_engine.py --shape 27B --variants tc64inv --skip-long --skip-decode \
        --wall-split --json "$OUT/engine.json" > "$OUT/bench_engine.log" 2>&1
    grep -E '^(---|[a-d]_)' "$OUT/bench_engine.log" | cut -c1-220
fi
