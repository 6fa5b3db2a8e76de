#!/usr/bin/env bash
# On the GPU machine, from the repo root: the body's last layer at the read rows only
# (`ForestBody(last_layer="reads")`, engine/run/layers.py `_last_layer_at_reads`) against the full
# last layer, in one process on one 27B weight build.
#   STAGE=tests bash ops/device/lastlayer_check.sh   # its CUDA tests (~2 min)
#   STAGE=bench bash ops/device/lastlayer_check.sh   # (a)-(d), three variants (~4 min)
# Variants (ops/bench/bench_engine.py VARIANTS): tc64inv (the new default: reads, unsplit read
# attention), tc64inv-fulllast (the former full last layer), tc64inv-reads16 (reads, the read rows'
# attention split over their keys as the decoder's). Each non-full variant also records
# lastlayer_{b,c}_vs_full: the states' bits (must be equal), the read logits' bits, the largest
# relative logit change and whether the answers agree, against an eager full-last-layer twin.
# Carry .gpuwheels (and .cache/cutlass for the CUTLASS GEMMs). Uses GPU 0. Prints one table.
set -uo pipefail
STAGE=${STAGE:-all}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
if [ "$STAGE" != bench ]; then
    python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs \
        tests/engine/kernels/test_kernel_forest_attention.py -k "parts_give or decode_kernel or 27b_keys or 27b_read_rows" \
        2>&1 | tee "$OUT/pytest_lastlayer_kernels.log" | tail -3
    python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs \
        tests/engine/body/test_body_last_layer.py tests/engine/body/test_input_groups.py tests/engine/body/test_body.py \
        2>&1 | tee "$OUT/pytest_lastlayer_body.log" | tail -3
fi
if [ "$STAGE" != tests ]; then
    python3 ops/bench/bench_engine.py --shape 27B --variants "${VARIANTS:-tc64inv,tc64inv-fulllast,tc64inv-reads16}" \
        --skip-decode --json "$OUT/lastlayer_27B.json" ${BENCH_ARGS:-} >"$OUT/lastlayer_27B.log" 2>&1
    echo "bench rc=$?"
    python3 - "$OUT/lastlayer_27B.json" <<'EOF'
import json, sys

res = json.load(open(sys.argv[1]))
keys = ("a_one_question_256", "b_three_questions_256", "c_one_question_8192")
print(f"{'variant':<18} {'(a) ms':>14} {'(b) ms':>14} {'(c) ms':>16} {'(d) req/s':>9}")
for name, r in res.items():
    cells = [f"{r[k]['mean_ms']:.2f} ({r[k]['p99_ms']:.2f})" if k in r else "-" for k in keys]
    d = r.get("d_64_clients_req_per_s")
    print(f"{name:<18} {cells[0]:>14} {cells[1]:>14} {cells[2]:>16} {d if d is None else round(d, 1)!s:>9}")
for name, r in res.items():
    for k in ("lastlayer_b_vs_full", "lastlayer_c_vs_full"):
        if k in r:
            print(f"{name:<18} {k}: {r[k]}")
EOF
fi
