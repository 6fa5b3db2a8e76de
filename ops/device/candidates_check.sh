#!/usr/bin/env bash
# On the GPU machine, from the repo root: the candidates sessions 16 and 17 built on the CPU (every
# one off by default and bit-identical to the default by test), their CUDA bit tests and their
# timings, in stages that each fit one 10-minute call:
#   STAGE=engine  [VARIANTS=tc64inv,...] bash ops/device/candidates_check.sh  # 27B prefill, profiles (~5 min)
#   STAGE=decode  [DECODE_VARIANTS=...]  bash ops/device/candidates_check.sh  # 27B decode, step profiles (~4 min)
#   STAGE=kernels bash ops/device/candidates_check.sh  # CUTLASS tiles, SwiGLU rows, GDN split (~7 min)
#   STAGE=tests   bash ops/device/candidates_check.sh  # CUDA bit tests of the candidates alone (~3 min)
#   STAGE=session bash ops/device/candidates_check.sh  # the engine's variants, then the whole CUDA set (~9 min)
#   STAGE=rows    bash ops/device/candidates_check.sh  # the row kernels' candidates at 256 / 8,192 rows (~1 min)
#   STAGE=gemm64  bash ops/device/candidates_check.sh  # decode GEMMs by shape in the step vs alone (~4 min)
#   STAGE=narrow64 bash ops/device/candidates_check.sh # 64x40 / 64x32 tiles for the decoder's narrow outputs (~2 min)
#   STAGE=pairs   bash ops/device/candidates_check.sh  # the one-GEMM SwiGLU: bit tests, alone, tile A/B (~10 min)
#   STAGE=oldnew  bash ops/device/candidates_check.sh  # an older commit's default against this one's (~2 min)
#   STAGE=fmha    bash ops/device/candidates_check.sh  # the FMHA long tier: CUDA tests, 27B A/B with clocks (~7 min)
#   STAGE=fmhaacc bash ops/device/candidates_check.sh  # the FMHA long tier: 4B accuracy against fp32, both ways (~4 min)
#   STAGE=first   bash ops/device/candidates_check.sh  # a scarce machine's one call: the whole CUDA set and #27's
#                                                      # figures; on an H200 #19's decode figures, else (c)'s profile (~9 min)
#   STAGE=draw    bash ops/device/candidates_check.sh  # the whole CUDA set, then 27B decode with the draw in the
#                                                      # step (the default) against the host's draw, 1 and 64 sequences (~6 min)
#   STAGE=thinking bash ops/device/candidates_check.sh # 27B decode step profiles and thinking requests (~5 min)
# STAGE=session is the one call for a session whose machine starts are scarce (session 19 got one
# start in eight tries, each failed try costing 1.5-3 device minutes): the default against
# SESSION_VARIANTS with --wall-split (each host step of a pass timed: `steps_us`), then
# `JOBS=8 gpu_suite.sh` in what is left of the 10 minutes. `SESSION_VARIANTS= STAGE=session`
# (empty) times the default alone: the call that measures the H200 targets at a commit.
# The order that spends a session's 30 device minutes best: engine, decode (they decide which
# defaults flip), kernels if time allows; then the whole CUDA test set at the commit that flips
# them (`JOBS=8 bash ops/device/gpu_suite.sh`, one call if it fits; else `PART=1|2|3`, three: the
# candidates' bit tests are in those parts, STAGE=tests is for a session that cannot run the whole
# set) and one `bench_engine.py --shape 27B --variants tc64inv` at that same commit.
# Candidates: forest_attention.CONCURRENT_TIERS (the large-block tiers on a side stream),
# forest_gdn.TC_INVERT_SPLIT (the invert prep in three kernels), decode_quant.RESIDENT_ORDERED /
# RECOMPUTE_ROWS (the SwiGLU quantizer's ordered loads and recompute split), top_k.TOP_K_FORM
# "kernel" (the sampler's top-k in two Triton kernels), decode_gdn.BLOCK_V / NUM_WARPS (the
# decoder's GDN step), the CUTLASS tiles in clusters of two along M and with 256-deep K steps,
# 64-row tiles as a narrow choice (cutlass_gemm.HALF_ROW_TILES, on since session 17), and
# the host path's cuts (in the tree already: `--wall-split` shows them). Every engine run also
# times `b_readme_three_questions`, the seed's (b).
# Carry .gpuwheels and .cache/cutlass (the kernels stage needs the candidates' library, built with
#   python ops/build_cutlass.py --candidates --configs "$CUTLASS_CONFIGS"
# with the list below). Results: $OUT/*.log, *.json.
set -uo pipefail
STAGE=${STAGE:-engine}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
source ops/device/setup.sh
K=tests/engine/kernels
CUTLASS_CONFIGS=p128x128x128,p128x128x128_cl2x1,p128x96x128,p128x64x128,p128x96x128_cl2x1,p128x64x128_cl2x1,p128x128x256,p128x128x256_sw8,p128x96x256,p128x128x128_sw8,p128x128x128_cl1x2
case "$STAGE" in
engine)
    # VARIANTS: the default and what is to be A/B'd against it (session 17 timed concurrenttiers,
    # invertsplit and nohalfrowtiles: all off now); --wall-split prints the read-outs' profile
    timeout 560 python3 ops/bench/bench_engine.py --shape 27B --skip-decode --skip-checks --wall-split \
        --variants "${VARIANTS:-tc64inv}" --profile "$OUT/profile" \
        --json "$OUT/engine-candidates.json" \
        > "$OUT/engine-candidates.log" 2>&1
    grep -iE "^(---|a_|b_|c_|d_)" "$OUT/engine-candidates.log" | cut -c1-220 | tail -40
    ;;
decode)
    # the default's step profile at 1 and 64 sequences (the last one, session 15's, ran the
    # fp32-dot body path), then DECODE_VARIANTS if named (session 17: topkkernel +1%, gdnstepv64
    # +5.7% at 64 and -2.8% at one sequence, other bits)
    # (session 22 built the sampler's top-k inside the step's graph: steptopk, steptopkkernel)
    DECODE_VARIANTS=${DECODE_VARIANTS-tc64inv-hostdraw,tc64inv-gdnstepv64}
    timeout 560 python3 ops/bench/bench_engine.py --shape 27B --decode-only \
        --variants "tc64inv${DECODE_VARIANTS:+,$DECODE_VARIANTS}" --decode-profile "$OUT/decprof" \
        --json "$OUT/decode-candidates.json" > "$OUT/decode-candidates.log" 2>&1
    grep -E "^(---|e_)" "$OUT/decode-candidates.log" | tail -30
    ;;
kernels)
    timeout 240 python3 ops/bench/bench_cutlass.py --candidates --configs "$CUTLASS_CONFIGS" \
        --m 128,256,384,8192 --json "$OUT/cutlass-candidates.json" > "$OUT/cutlass-candidates.log" 2>&1
    tail -40 "$OUT/cutlass-candidates.log"
    timeout 150 python3 ops/bench/bench_rows.py --kernels swiglu+quant --rows 256,8192,64 --budget-s 110 \
        --out "$OUT/rows-swiglu.json" > "$OUT/rows-swiglu.log" 2>&1
    tail -30 "$OUT/rows-swiglu.log"
    timeout 180 python3 ops/bench/bench_gdn.py --no-fla --out "$OUT/gdn-split.json" \
        --paths "split bf16 inv,split bf16 inv3,split bf16 inv3 wu8" > "$OUT/gdn-split.log" 2>&1
    tail -30 "$OUT/gdn-split.log"
    ;;
pairs)
    # the one-GEMM SwiGLU (the default since session 27, over the interleaved stored weight): its
    # CUDA bit tests, the engine's MLP call alone at 27B (bench_swiglu.py, bits checked), then the
    # engine A/B in one process (PAIRS_VARIANTS: the clustered tile above 2,048 rows against the
    # default's swizzled one)
    timeout 130 python3 -m pytest -q -p no:cacheprovider tests/engine/kernels/test_kernel_cutlass_gemm.py \
        tests/engine/kernels/test_kernel_int8_gemm_swiglu.py tests/engine/body/test_input_groups.py \
        -k "swiglu or mlp or interleaved" > "$OUT/pairs-tests.log" 2>&1
    echo "tests rc=$?"; tail -4 "$OUT/pairs-tests.log"
    timeout 90 python3 ops/bench/bench_swiglu.py --models 27B --m 384,8192 --budget-s 0 \
        --out "$OUT/swiglu-pairs.json" > "$OUT/swiglu-pairs.log" 2>&1
    echo "swiglu rc=$?"; grep -E "M=|MISMATCH" "$OUT/swiglu-pairs.log" | cut -c1-300
    timeout 360 python3 ops/bench/bench_engine.py --shape 27B --skip-decode --skip-checks \
        --variants "${PAIRS_VARIANTS:-tc64inv,tc64inv-swiglucluster,tc64inv}" \
        --json "$OUT/engine-pairs.json" > "$OUT/engine-pairs.log" 2>&1
    echo "bench rc=$?"
    grep -E "^(---|a_one|a_timed|b_three|b_readme|c_one|d_64)" "$OUT/engine-pairs.log" | cut -c1-400
    ;;
oldnew)
    # the default of an older commit (ops/device/old_tree.sh REV on the dev machine; carry
    # .cache/oldtree) against this tree's, old, new, old, new, one process each on this machine
    # (OLDNEW_VARIANTS: each tree's variants, tc64inv by default; a variant must exist in both)
    root=$PWD
    lib=$root/.cache/cutlass/$(cat .cache/oldtree/CUTLASS_DIGEST 2>/dev/null)/libprism_int8_gemm.so
    [ -f "$lib" ] || { echo "no old tree or its library: run ops/device/old_tree.sh REV here, carry .cache/oldtree"; exit 1; }
    run_tree() {  # $1 label, $2 tree, $3 its CUTLASS library (the old tree's)
        (cd "$2" && env PYTHONPATH="/tmp/site:$PWD" ${3:+PRISM_CUTLASS_LIB="$3"} timeout 140 python3 \
            ops/bench/bench_engine.py --shape 27B --skip-decode --skip-checks \
            --variants "${OLDNEW_VARIANTS:-tc64inv}" --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1)
        echo "$1 rc=$?"
    }
    echo "old tree $(cat .cache/oldtree/REV)"
    run_tree old1 .cache/oldtree "$lib"; run_tree new1 "$root"; run_tree old2 .cache/oldtree "$lib"
    run_tree new2 "$root"
    for f in old1 new1 old2 new2; do
        echo "== $f (CUTLASS library loaded: $(grep -c cutlass_loaded "$OUT/$f.log"))"; grep -E "^(---|a_one|b_three|b_readme|c_one|d_64)" "$OUT/$f.log" | cut -c1-130
    done
    ;;
fmha)
    # session 29's FMHA long tier (`forest_attention.FMHA_LONG_TIER`, the CUTLASS library's FMHA
    # unit): its CUDA tests (the kernel against its torch reference, alone == packed, the tier in
    # forest_attention), then the 27B engine A/B (FMHA_VARIANTS) with the SM clock sampled beside
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active \
        --format=csv -lms 500 > "$OUT/clocks.csv" 2>/dev/null &
    sampler=$!
    timeout 200 python3 -m pytest -q -p no:cacheprovider $K/test_kernel_forest_attention.py -k "fmha or 27b_tiers" \
        > "$OUT/fmha-tests.log" 2>&1
    echo "tests rc=$?"; tail -6 "$OUT/fmha-tests.log"
    timeout 330 python3 ops/bench/bench_engine.py --shape 27B --skip-decode --skip-checks \
        --variants "${FMHA_VARIANTS:-tc64inv,tc64inv-fmha,tc64inv-fmhaqbf16,tc64inv}" \
        --json "$OUT/engine-fmha.json" > "$OUT/engine-fmha.log" 2>&1
    echo "bench rc=$?"
    kill "$sampler" 2>/dev/null
    grep -E "^(---|a_one|b_three|b_readme|c_one|d_64)" "$OUT/engine-fmha.log" | cut -c1-400
    tail -3 "$OUT/engine-fmha.log"
    ;;
first)
    # one call that spends a scarce machine on what that card can settle (session 31): the whole
    # CUDA set at this commit first (the FMHA tier became the CUDA default in session 30 after the
    # last set had run), then #27's figures; on an H200 then #19's decode figures (27B at 1 and 64
    # sequences, 4B), elsewhere the profile of (c) under the default (--profile profiles the first
    # variant). The FMHA tier's A/B (`STAGE=fmha`) and 4B accuracy (`STAGE=fmhaacc`) were recorded
    # in session 30.
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active \
        --format=csv -lms 500 > "$OUT/clocks.csv" 2>/dev/null &
    sampler=$!
    h200=0
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && h200=1
    JOBS=8 SUITE_TIMEOUT=280 bash ops/device/gpu_suite.sh 2>&1 | tail -12
    # the default twice beside FIRST_CANDIDATE, a same-bits prefill candidate that flips if (c)
    # lands within a few ms of 439.8 (the default: zeroed dead rows only and the gated norm in
    # tiles of heads, session 30's D2 pair, ~2 ms of (c) on the H100)
    cand=${FIRST_CANDIDATE:-tc64inv-prefill22}
    if [ "$h200" = 1 ]; then
        timeout 240 python3 ops/bench/bench_engine.py --shape 27B --skip-decode --skip-checks \
            --variants "tc64inv,$cand,tc64inv,$cand" \
            --json "$OUT/engine-first.json" > "$OUT/engine-first.log" 2>&1
    else
        timeout 260 python3 ops/bench/bench_engine.py --shape 27B --skip-decode --skip-checks \
            --variants "tc64inv,$cand,tc64inv,$cand" --profile "$OUT/profile" \
            --json "$OUT/engine-first.json" > "$OUT/engine-first.log" 2>&1
    fi
    echo "bench rc=$?"
    grep -E "^(---|a_one|b_three|b_readme|c_one|d_64|c_profile_fam)" "$OUT/engine-first.log" | cut -c1-400
    left=$(( ${CALL_S:-590} - 15 - SECONDS ))  # CALL_S: the call's own limit, where less than 590
    if [ "$h200" = 1 ] && [ "$left" -ge 60 ]; then
        timeout "$left" python3 ops/bench/bench_engine.py --shape 27B --decode-only --decode-sequences 1,64 \
            --variants tc64inv --json "$OUT/decode-27b.json" > "$OUT/decode-27b.log" 2>&1
        echo "decode 27B rc=$?"; grep -E "^(---|e_decode)" "$OUT/decode-27b.log"
        left=$(( ${CALL_S:-590} - 15 - SECONDS ))
        if [ "$left" -ge 40 ]; then
            timeout "$left" python3 ops/bench/bench_engine.py --shape 4B --decode-only --decode-sequences 1,64 \
                --variants tc64inv --json "$OUT/decode-4b.json" > "$OUT/decode-4b.log" 2>&1
            echo "decode 4B rc=$?"; grep -E "^(---|e_decode)" "$OUT/decode-4b.log"
        fi
    fi
    kill "$sampler" 2>/dev/null
    ;;
draw)
    # session 32's draw inside the decode step (`decoder.DRAW_IN_STEP`) and the loop running ahead
    # (`thoughts.RUN_AHEAD`), both the default since: the whole CUDA set at this commit (their bit
    # tests are in the decoder's files), then the 27B decode A/B against the host's draw, interleaved
    JOBS=8 SUITE_TIMEOUT=${SUITE_TIMEOUT:-280} bash ops/device/gpu_suite.sh 2>&1 | tail -12
    left=$(( ${CALL_S:-590} - 15 - SECONDS ))
    timeout "$left" python3 ops/bench/bench_engine.py --shape 27B --decode-only --decode-sequences 1,64 \
        --decode-steps 64 --variants "${DRAW_VARIANTS:-tc64inv-hostdraw,tc64inv-stepdraw,tc64inv,tc64inv-hostdraw,tc64inv}" \
        --json "$OUT/decode-draw.json" > "$OUT/decode-draw.log" 2>&1
    echo "decode rc=$?"; grep -E "^(---|e_decode)" "$OUT/decode-draw.log"; tail -3 "$OUT/decode-draw.log"
    ;;
thinking)
    # #19's remaining H200 records after STAGE=first: the per-kernel profile of a decode step at 1
    # and 64 sequences and the thinking requests (128-token thoughts, 1 and 16 concurrent), 27B
    timeout $(( ${CALL_S:-590} - 15 )) python3 ops/bench/bench_engine.py --shape 27B --decode-only \
        --decode-sequences 1,64 --decode-steps 64 --thinking --decode-profile "$OUT/decprof" \
        --variants tc64inv --json "$OUT/decode-thinking.json" > "$OUT/decode-thinking.log" 2>&1
    echo "decode rc=$?"; grep -E "^(---|e_decode|e_profile_[0-9]+_(graph|gpu|fam)|f_)" "$OUT/decode-thinking.log" | cut -c1-400
    ;;
fmhaacc)
    # #27's accuracy check for the FMHA tier at 4B: the default's read-outs and the FMHA tier's
    # against the fp32 path (2,048-token forests reach the long tier, >= 1,024 tokens)
    for on in False True; do
        timeout 260 python3 ops/bench/bench_engine.py --shape 4B --accuracy --accuracy-settings tc64inv \
            --accuracy-long 4 --set "engine.kernels.forest_attention.FMHA_LONG_TIER=$on" \
            --json "$OUT/accuracy-fmha-$on.json" > "$OUT/accuracy-fmha-$on.log" 2>&1
        echo "accuracy FMHA=$on rc=$?"; grep -E "tc64inv" "$OUT/accuracy-fmha-$on.log" | cut -c1-400
    done
    ;;
session)
    # SESSION_VARIANTS: what is A/B'd against the default (set it empty for the default alone;
    # by default session 21's attention output without its fill; session 22's gated-norm forms are
    # timed as kernels by STAGE=rows, bit-identical to the default by test)
    SESSION_VARIANTS=${SESSION_VARIANTS-tc64inv-attnzerodead}
    timeout 220 python3 ops/bench/bench_engine.py --shape 27B --skip-decode --skip-checks --wall-split \
        --variants "tc64inv${SESSION_VARIANTS:+,$SESSION_VARIANTS}" \
        --json "$OUT/engine-session.json" > "$OUT/engine-session.log" 2>&1
    echo "bench rc=$?"
    grep -E "^(---|a_one|a_timed|b_three|b_readme|c_one|d_64|a_wall_split |b_wall_split )" "$OUT/engine-session.log" | cut -c1-1200
    JOBS=8 SUITE_TIMEOUT=${SUITE_TIMEOUT:-300} bash ops/device/gpu_suite.sh 2>&1 | tail -12
    ;;
rows)
    # session 22's gated-norm forms (tiles of heads, o and z loaded before the sums) beside the
    # padded default, and the v quantizer over its divisor, at the (a)/(b) and (c) row counts
    timeout 240 python3 ops/bench/bench_rows.py --kernels "gated+quant,v quant/div" --rows 256,8192,64 \
        --budget-s 200 --out "$OUT/rows-gated.json" > "$OUT/rows-gated.log" 2>&1
    tail -30 "$OUT/rows-gated.log"
    ;;
gemm64)
    # session 23's open question: the 64-sequence decode step's GEMMs take 10.8 ms (H100 profile)
    # where bench_cutlass's cold-weight sums for the same configs say ~7.4. The step profile now
    # charges each GEMM shape its time inside the real step (`e_profile_64_gemm_M=64_N=.._K=..`,
    # with its weight's TB/s and layout); bench_cutlass --m 64 gives the same shapes alone.
    timeout 300 python3 ops/bench/bench_engine.py --shape 27B --decode-only --variants tc64inv \
        --decode-profile "$OUT/decprof" --json "$OUT/decode-gemms.json" > "$OUT/decode-gemms.log" 2>&1
    grep -E "^(e_decode|e_profile_(1|64)_(graph_step|gpu_busy|gemm))" "$OUT/decode-gemms.log" | cut -c1-260
    timeout 200 python3 ops/bench/bench_cutlass.py --m 64 --json "$OUT/cutlass64.json" \
        > "$OUT/cutlass64.log" 2>&1
    tail -30 "$OUT/cutlass64.log" | cut -c1-250
    ;;
narrow64)
    # session 24: at M 64 the 5,120-wide outputs make 80 tiles of 64x64 for 132 SMs and read their
    # weights at 1.7-2.4 TB/s in the H100's step; 64x40 (128 tiles) and 64x32 (160) beside 64x64.
    # The candidates' library: python ops/build_cutlass.py --candidates --configs p64x64x256,p64x40x256,p64x32x256
    timeout 300 python3 ops/bench/bench_cutlass.py --candidates --configs p64x64x256,p64x40x256,p64x32x256 \
        --m 64,32 --json "$OUT/cutlass-narrow64.json" > "$OUT/cutlass-narrow64.log" 2>&1
    echo "bench rc=$?"
    tail -16 "$OUT/cutlass-narrow64.log" | cut -c1-300
    ;;
tests)
    timeout 400 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs --confcutdir=$K \
        -k "27b_tiers_beside or swiglu or invert or settings_match_reference or top_k" \
        $K/test_kernel_forest_attention.py $K/test_kernel_decode.py $K/test_kernel_forest_gdn.py \
        $K/test_kernel_top_k.py 2>&1 | tee "$OUT/pytest_candidates.log" | tail -8
    timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs \
        tests/engine/body/test_host_tables.py tests/engine/test_readout.py $K/test_kernel_vocab_mass.py \
        tests/engine/test_batch_sampling.py 2>&1 | tee "$OUT/pytest_host.log" | tail -4
    ;;
*) echo "STAGE must be engine, decode, kernels, rows, gemm64, narrow64, tests or session"; exit 2 ;;
esac
