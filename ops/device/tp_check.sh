#!/usr/bin/env bash
# On a 2-GPU machine, from the repo root: tensor parallelism on the GPUs. The bitwise tests
# (1 GPU vs 2 GPUs over NCCL, and the gloo CPU case), the int8 invariance tests on CUDA, then
# the 27B shape on 2 GPUs (bench_tp) beside one GPU (bench_engine) in the same session.
# Needs the wheels the image lacks in .gpuwheels/ (carry it).
set -uo pipefail
source ops/device/setup.sh
export NCCL_NVLS_ENABLE=0  # NVLink multicast off (see KINDS.md)
python3 -m pytest tests/engine/test_tp.py tests/engine/test_int8_invariance.py -k "cuda or tp" -q \
    --confcutdir=tests/engine -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$OUT/pytest_tp.log" | tail -5
python3 ops/bench/bench_tp.py --shape "${SHAPE:-27B}" --tp 2 --json "$OUT/bench_tp2.json" ${TP_ARGS:-} \
    2>&1 | tee "$OUT/bench_tp2.log" | grep -v "^\s*$" | tail -14
if [ -z "${SKIP_ONE:-}" ]; then
    python3 ops/bench/bench_engine.py --shape "${SHAPE:-27B}" --json "$OUT/bench_tp1.json" ${ONE_ARGS:-} \
        2>&1 | tee "$OUT/bench_tp1.log" | grep -v "^\s*$" | tail -14
fi
