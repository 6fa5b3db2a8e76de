#!/usr/bin/env bash
# On the GPU machine, from the repo root: the benchmark as users read it.
#   STAGE=peer      bash ops/device/bench_report.sh  # (a)-(d) for VARIANTS (default "body,tc") and
#                                                    # the peer (transformers bf16, fla if carried)
#                                                    # in one process per shape, then the chart
#   STAGE=accuracy  bash ops/device/bench_report.sh  # body settings vs the fp32 path (ACC_SHAPE, 4B)
#   bash ops/device/bench_report.sh                  # both
# SHAPES (default "27B"). Writes $OUT/peer_<shape>.json/.log, $OUT/chart_<shape>.png,
# $OUT/accuracy_<shape>.json/.log. Needs .gpuwheels (carry it). Uses GPU 0.
set -uo pipefail
STAGE=${STAGE:-all}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
if [ "$STAGE" != accuracy ]; then
    for shape in ${SHAPES:-27B}; do
        python3 ops/bench/bench_engine.py --shape "$shape" --variants "${VARIANTS:-body,tc}" --peer --skip-decode \
            --json "$OUT/peer_$shape.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/peer_$shape.log" \
            | grep -E '^(---|[a-d]_|peer_|[a-z0-9-]+_vs_peer|build_s|peak)' | cut -c1-200
        python3 ops/bench/plot.py "$OUT/peer_$shape.json" --out "$OUT/chart_$shape.png" \
            --title "Prism $shape int8 vs transformers bf16, H200 ($(git log -1 --format=%h 2>/dev/null))"
    done
fi
if [ "$STAGE" != peer ]; then
    shape=${ACC_SHAPE:-4B}
    python3 ops/bench/bench_engine.py --shape "$shape" --accuracy --json "$OUT/accuracy_$shape.json" \
        ${ACC_ARGS:-} 2>&1 | tee "$OUT/accuracy_$shape.log" | grep -vE '^\s*$' | cut -c1-250
fi
