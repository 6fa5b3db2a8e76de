"""Time the engine's Triton kernels against their torch counterparts at 27B shapes (CUDA only).

    PYTHONPATH=. python3 ops/bench/bench_kernels.py [--out results.json] [--quick]

Medians of `triton.testing.do_bench` on random data; prints one table. The GEMM section
sweeps fixed candidate configs at every int8 linear of the 27B and 4B shapes and M from 1
(decode) to 8,192 (prefill), checks each candidate's bits against the torch reference (int32
accumulation is exact, so every config must give identical bits), prints TOP/s and GB/s and
the GEMM time per forward (table / best / HBM floor), and writes JSON from which
engine.kernels.int8_gemm.CONFIG_TABLE and SHAPE_TABLE are set. `--gemm-only` runs just that
(~3-4 minutes on an H200; `--budget-s` bounds it).
"""

# Every lambda below is timed inside the loop iteration that made it, so late binding is moot.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import sys

import torch

from engine.kernels.int8_gemm import GemmConfig, config_for, int8_gemm, int8_gemm_reference
from engine.kernels.quant import (
    quantize_rows,
    quantize_rows_reference,
    rms_norm_quantize,
    rms_norm_quantize_reference,
)

# Decode candidates (M <= 64): weight streaming - narrow N tiles, long K steps, split K. The
# first sweep (RESULTS.md, tree 7546c16) dropped split 8, 32-row tiles, split tiles of 128 and
# 64x64 split 4 (never within 2% of a shape's best).
DECODE_CANDIDATES = [
    GemmConfig(64, 128, 128, 4, 4),  # the prefill tile; best at M = 64 for wide N
    GemmConfig(16, 64, 256, 4, 4),
    GemmConfig(16, 32, 512, 4, 4),
    GemmConfig(16, 128, 256, 4, 4),
    GemmConfig(16, 128, 512, 4, 3),
    GemmConfig(16, 256, 128, 4, 4),
    GemmConfig(16, 256, 256, 8, 3),
    GemmConfig(16, 64, 256, 4, 4, split_k=2),
    GemmConfig(16, 64, 256, 4, 4, split_k=4),
    GemmConfig(16, 128, 256, 4, 4, split_k=4),
    GemmConfig(16, 64, 512, 4, 3, split_k=4),
    GemmConfig(16, 64, 256, 4, 4, split_k=4, split_fused=False),
    GemmConfig(64, 64, 256, 4, 4, split_k=2),
    # M = 64 (64 decode rows): deeper pipelines and wider tiles over the stacked shapes, whose
    # 16,480-34,816 columns give enough tiles without split K
    GemmConfig(64, 128, 256, 4, 3),
    GemmConfig(64, 128, 128, 4, 6),
    GemmConfig(64, 256, 128, 8, 3),
    GemmConfig(64, 64, 256, 4, 5),
    GemmConfig(64, 128, 128, 4, 4, persistent=True),
    # the dp4a GEMV (M <= block_m rows; a candidate only there): weight rows per program, K step
    GemmConfig(1, 8, 1024, 4, 1, gemv=True),
    GemmConfig(1, 4, 1024, 2, 1, gemv=True),
    GemmConfig(1, 16, 1024, 4, 1, gemv=True),
    GemmConfig(1, 8, 2048, 4, 1, gemv=True),
    GemmConfig(1, 8, 512, 2, 1, gemv=True),
    GemmConfig(1, 16, 2048, 8, 1, gemv=True),
    GemmConfig(1, 32, 1024, 8, 1, gemv=True),
    GemmConfig(4, 8, 512, 4, 1, gemv=True),
    GemmConfig(4, 4, 1024, 4, 1, gemv=True),
    GemmConfig(4, 16, 512, 8, 1, gemv=True),
    GemmConfig(4, 8, 1024, 8, 1, gemv=True),
]
# M in (4, 16] and (16, 64]: decode at 16 and 64 sequences. Each list holds the shipped
# tables' configs for its M (so every linear's table config is also a candidate), the earlier
# sweeps' winners, and stream K (`stream_k`: every SM streams an equal share of the steps, one
# wave whatever the tile count). The lists are short so that `--m 16,64 --models 27B` stays
# within two minutes on an H200 with its compiles (`--jobs`).
M16_CANDIDATES = [
    GemmConfig(16, 32, 512, 4, 4),  # CONFIG_TABLE at M <= 16
    GemmConfig(16, 128, 256, 4, 4),
    GemmConfig(16, 256, 256, 8, 3),
    GemmConfig(16, 64, 256, 4, 4),
    GemmConfig(16, 64, 256, 4, 4, split_k=2),
    GemmConfig(16, 64, 512, 4, 3, split_k=4),
    GemmConfig(16, 128, 256, 4, 4, stream_k=1),  # 3 stages of 32 KB weight in flight per SM
    GemmConfig(16, 64, 512, 4, 4, stream_k=1),  # 512 contiguous bytes of each weight row a step
    GemmConfig(16, 128, 512, 4, 3, stream_k=1),
    GemmConfig(16, 256, 256, 8, 3, stream_k=1),
    GemmConfig(16, 128, 256, 4, 3, stream_k=2),  # two programs per SM (80 KB shared each)
    GemmConfig(16, 128, 128, 4, 6, stream_k=2),
]
M64_CANDIDATES = [
    GemmConfig(64, 128, 128, 4, 4),  # CONFIG_TABLE at M <= 384
    GemmConfig(64, 64, 256, 4, 4, split_k=2),  # SHAPE_TABLE at M <= 64 for N = 5,120
    GemmConfig(64, 128, 256, 4, 3),
    GemmConfig(64, 128, 128, 4, 6),
    GemmConfig(64, 256, 128, 8, 3),
    GemmConfig(64, 64, 256, 4, 5),
    GemmConfig(64, 64, 128, 4, 4, split_k=4),  # N = 5,120: 320 programs, all in one wave (3 per SM)
    GemmConfig(64, 128, 128, 4, 4, stream_k=1),
    GemmConfig(64, 128, 128, 4, 6, stream_k=1),  # 5 stages of 16 KB weight in flight per SM
    GemmConfig(64, 128, 256, 4, 3, stream_k=1),
    GemmConfig(64, 128, 256, 4, 4, stream_k=1),  # 224 KB shared: 3 x 32 KB in flight
    GemmConfig(64, 64, 256, 4, 4, stream_k=1),
    GemmConfig(64, 128, 128, 8, 5, stream_k=1),  # two warp groups issue the loads
]
# M in (64, 384]: the one- and few-question requests (a), (b). The shipped tables' configs, and
# stream K: at these M the N = 5,120 linears have 80-160 tiles for 132 SMs (a third to half a
# wave idle) and the wide stacked ones end in a ragged last wave; stream K gives every SM an
# equal share of the (tile, K block) steps in one wave.
M384_CANDIDATES = [
    GemmConfig(64, 128, 128, 4, 4),  # CONFIG_TABLE at M <= 384
    GemmConfig(128, 128, 128, 8, 3),
    GemmConfig(128, 128, 128, 4, 3, epilogue_split=2),
    GemmConfig(64, 128, 128, 4, 4, split_k=2),
    GemmConfig(64, 128, 128, 4, 4, stream_k=1),
    GemmConfig(64, 128, 128, 4, 3, stream_k=2),  # two programs per SM (104 KB shared each)
    GemmConfig(128, 128, 128, 8, 3, stream_k=1),
    GemmConfig(128, 128, 128, 8, 4, stream_k=1),
    # 2026-12-02 session 9: narrower column tiles for the N = 5,120 linears (80 column tiles:
    # 320 tiles at M = 256, 2.4 per SM with two programs each), deeper pipelines, the half-tile
    # epilogue at 64-row tiles, and the tile order (group_m) for the wide stacked linears' L2 reuse
    GemmConfig(64, 64, 256, 4, 4),
    GemmConfig(64, 64, 128, 4, 6),
    GemmConfig(128, 64, 128, 4, 4),
    GemmConfig(64, 128, 128, 4, 5),
    GemmConfig(64, 128, 64, 4, 8),
    GemmConfig(64, 256, 128, 8, 3, epilogue_split=2),
    GemmConfig(128, 128, 64, 4, 4, epilogue_split=2),
    GemmConfig(128, 256, 128, 8, 3, epilogue_split=2),
    GemmConfig(64, 128, 128, 4, 4, group_m=1),
    GemmConfig(64, 128, 128, 4, 4, group_m=16),
    GemmConfig(64, 64, 256, 4, 4, split_k=2),
]
# Prefill candidates (M >= 256). Run 1: 64x128 (two programs per SM) and 128x128/w8/s3 took
# 90 of 96 rows between them; the N = 5,120 linears (K = 6,144 / 17,408, fp32 residual) reach
# only 790-920 TOP/s at M = 1,024 (40 column tiles: 3 waves of 2.4 on 132 SMs, and an epilogue
# no main loop overlaps). 128x256 and 256x128 tiles with 8 warps spill (248-376 B) unless the
# epilogue runs on half tiles (/e2: 0 B, sm_90 compile); never-winners of run 1 are gone.
PREFILL_CANDIDATES = [
    GemmConfig(64, 128, 128, 4, 4),
    GemmConfig(128, 128, 128, 8, 3),
    GemmConfig(128, 128, 128, 8, 4),
    GemmConfig(128, 256, 128, 8, 3, epilogue_split=2),
    GemmConfig(256, 128, 128, 8, 3, epilogue_split=2),
    GemmConfig(64, 128, 128, 4, 4, persistent=True),
    GemmConfig(64, 256, 128, 8, 4, persistent=True),
    GemmConfig(128, 256, 128, 8, 4, persistent=True),
    GemmConfig(128, 256, 128, 8, 4, persistent=True, epilogue_split=2),
    GemmConfig(256, 128, 128, 8, 3, persistent=True, epilogue_split=2),
    # two programs per SM (<= 114 KB shared, <= 255 registers x 128 threads): one's epilogue
    # overlaps the other's main loop
    GemmConfig(128, 128, 64, 4, 4, epilogue_split=2),
    GemmConfig(128, 128, 128, 4, 3, epilogue_split=2),
    # warp-specialized persistent (a TMA producer warp group, two MMA/epilogue groups: 12 warps
    # compiled from num_warps=4; with 8, or with a split epilogue, Triton 3.6 does not specialize)
    GemmConfig(128, 128, 128, 4, 3, persistent=True, warp_specialize=True),
    GemmConfig(128, 128, 128, 4, 4, persistent=True, warp_specialize=True),
    GemmConfig(128, 128, 64, 4, 5, persistent=True, warp_specialize=True),
    # split K for the waves: twice the tiles for N = 5,120 (exact int32 slices, one epilogue)
    GemmConfig(64, 128, 128, 4, 4, split_k=2),
    GemmConfig(128, 128, 128, 8, 3, split_k=2),
]
SWEEP_M = [1, 4, 16, 64, 256, 384, 512, 1024, 2048, 8192]
DECODE_MAX_M = 64
HBM_BYTES_PER_S = 4.27e12
DEVICE = "cuda"  # module-level so a CPU smoke run of the sweep's bookkeeping can swap it


def bench(fn, rep: int = 100, warmup: int = 25) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


L2_FLUSH_BYTES = 256 << 20  # > the H200's 50 MB L2: weights cycled through this much are cold


def bench_stream(fn, weights: list[torch.Tensor], min_ms: float = 3.0) -> float:
    """ms per call of `fn(w)` for w cycling through distinct copies of one weight, inside a CUDA
    graph: as in a captured decode step, no launch overhead shows and every call finds its
    weight outside L2 (a plain do_bench of a 10 us GEMM times the Python launch instead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) off the capture
        for w in weights:
            fn(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    reps = max(3, int(min_ms / max(start.elapsed_time(end), 1e-3)) + 1)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / (reps * len(weights))
    del graph
    return ms


def preflight(skip_ws: bool) -> int:
    """Every sweep candidate once at a small shape (edges in M and N, a residual), bits against
    the reference, one line each: run in its own process first (ops/device/gemm_check.sh), so a
    candidate that hangs or faults costs this run, not the sweep."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    m, n, k = 320, 1024, 1024  # divisible as the sweep's shapes: the compiles are reused there
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=DEVICE, generator=gen)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=DEVICE, generator=gen)
    a_s = torch.rand(m, device=DEVICE, generator=gen) * 0.05
    w_s = torch.rand(n, device=DEVICE, generator=gen) * 0.01
    r = torch.randn(m, n, device=DEVICE, generator=gen)
    want = int8_gemm_reference(a, w, a_s, w_s, r)
    bad = 0
    every = DECODE_CANDIDATES + M16_CANDIDATES + M64_CANDIDATES + M384_CANDIDATES + PREFILL_CANDIDATES
    for cfg in sweep_candidates(list(dict.fromkeys(every)), skip_ws):
        got = int8_gemm(a, w, a_s, w_s, r, config=cfg)
        torch.cuda.synchronize()
        ok = torch.equal(got, want)
        bad += not ok
        print(f"preflight {str(cfg):32s} {'bit-equal' if ok else 'MISMATCH'}", flush=True)
    return 1 if bad else 0


def sweep_candidates(cands: list[GemmConfig], skip_ws: bool) -> list[GemmConfig]:
    return [c for c in cands if not (skip_ws and c.warp_specialize)]


def candidates_for(m: int) -> list[GemmConfig]:
    """The configs swept at M rows: GEMVs and 16-row tiles up to 4, the 16- and 64-row decode
    lists up to 16 and 64, the few-question list up to 384, prefill tiles above."""
    if m <= 4:
        return DECODE_CANDIDATES
    if m <= 16:
        return M16_CANDIDATES
    if m <= DECODE_MAX_M:
        return M64_CANDIDATES
    if m <= 384:
        return M384_CANDIDATES
    return PREFILL_CANDIDATES


def _compile_job(job: tuple[str, list[tuple[int, int, int, bool]], GemmConfig]) -> str:
    """In a worker process: run `cfg` once at each (M, N, K, residual) of the sweep on
    uninitialized tensors, so that Triton compiles it for the sweep's exact argument
    specializations (each distinct one once) into its on-disk cache, where the sweep's process
    then finds it."""
    device, shapes, cfg = job
    try:
        for m, n, k, res in shapes:
            a = torch.empty(m, k, dtype=torch.int8, device=device)
            w = torch.empty(n, k, dtype=torch.int8, device=device)
            r = torch.zeros(m, n, device=device) if res else None
            int8_gemm(a, w, torch.zeros(m, device=device), torch.zeros(n, device=device), r, config=cfg)
        if device == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the sweep records the failure itself
        return f"{cfg}: {type(e).__name__}: {str(e)[:200]}"
    return ""


def precompile(models: list[str], ms: list[int], jobs: int, skip_ws: bool) -> None:
    """Compile every (candidate, table config) of the sweep in `jobs` processes first: the
    compiles, one to two seconds each, are most of a short sweep's time otherwise."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.perf_counter()
    per_cfg: dict[GemmConfig, list[tuple[int, int, int, bool]]] = {}
    for model in models:
        for name, n, k, _ in model_linears(model):
            for m in ms:
                if name == "lm_head" and m > DECODE_MAX_M:
                    continue
                res = name.endswith("+res")
                for cfg in [config_for(m, n, k), *sweep_candidates(candidates_for(m), skip_ws)]:
                    if not (cfg.gemv and cfg.block_m < m):
                        per_cfg.setdefault(cfg, []).append((m, n, k, res))
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        errors = [e for e in pool.map(_compile_job, [(DEVICE, v, c) for c, v in per_cfg.items()]) if e]
    print(
        f"# precompiled {len(per_cfg)} configs in {jobs} processes: {time.perf_counter() - t0:.0f} s"
        + "".join(f"\n#   {e}" for e in errors),
        flush=True,
    )


def model_linears(model: str) -> list[tuple[str, int, int, int]]:
    """(name, N, K, uses per decode step) of every int8 GEMM of `model` as the engine launches
    it: the linears that read one input run as one GEMM over their stacked rows
    (`engine.run.int8_rows.INPUT_GROUPS`: GDN qkv+z+b+a, attention q+gate+k+v, MLP gate+up), so
    those stacked shapes, not the separate linears, are what the table must be set for.
    Names ending in "+res" add the residual in the epilogue, as the model does."""
    from bench_engine import shape_config

    c = shape_config(model)
    n_attn = len(c.full_attention_layers)
    n_gdn = c.num_layers - n_attn
    h, inter = c.hidden_size, c.intermediate_size
    gdn_in = c.conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads
    attn_in = c.num_attention_heads * 2 * c.head_dim + 2 * c.num_kv_heads * c.head_dim
    return [
        ("gdn_in", gdn_in, h, n_gdn),
        ("gdn_out+res", h, c.linear_value_dim, n_gdn),
        ("attn_in", attn_in, h, n_attn),
        ("attn_out+res", h, c.num_attention_heads * c.head_dim, n_attn),
        ("mlp_gate_up", 2 * inter, h, c.num_layers),
        ("mlp_down+res", h, inter, c.num_layers),
        ("lm_head", c.vocab_size, h, 1),
    ]  # fmt: skip


def gemm_sweep(
    models: list[str],
    ms: list[int],
    budget_s: float,
    sweep: bool,
    partial_out: str | None = None,
    skip_ws: bool = False,
) -> dict:
    """Time every candidate config at every (model linear, M); check each one's bits against
    the torch reference; propose the table. Candidates after `budget_s` are skipped (listed).
    A candidate that fails to compile or run is recorded (`failed`) and the sweep goes on;
    `partial_out` gets the rows so far after each linear (a sweep cut short keeps its data)."""
    import time

    t_start = time.perf_counter()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows: list[dict] = []
    skipped = 0
    mismatches: list[str] = []
    failed: list[str] = []
    for model in models:
        for name, n, k, uses in model_linears(model):
            w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=DEVICE, generator=gen)
            ws = torch.rand(n, device=DEVICE, generator=gen) * 0.01
            copies = [w] + [w.clone() for _ in range(-(-L2_FLUSH_BYTES // w.numel()) - 1)]
            for m in ms:
                if name == "lm_head" and m > DECODE_MAX_M:
                    continue  # prefill reads the LM head only at the read positions
                a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=DEVICE, generator=gen)
                a_s = torch.rand(m, device=DEVICE, generator=gen) * 0.05
                r = torch.randn(m, n, device=DEVICE, generator=gen) if name.endswith("+res") else None
                ops, nbytes = 2.0 * m * n * k, n * k + m * k + 4 * m * n * (2 if r is not None else 1)
                ref = int8_gemm_reference(a, w, a_s, ws, r)
                table_cfg = config_for(m, n, k)
                table_exact = torch.equal(int8_gemm(a, w, a_s, ws, r), ref)
                t_table = bench_stream(lambda w: int8_gemm(a, w, a_s, ws, r), copies)
                t_intmm = bench_stream(lambda w: torch._int_mm(a, w.t()), copies) if m > 16 else None
                cands = {}
                if sweep:
                    for cfg in sweep_candidates(candidates_for(m), skip_ws):
                        if cfg.split_k > 1 and m > 2048:
                            continue  # thousands of tiles already; the slices would cost > 1 GB
                        if cfg.gemv and cfg.block_m < m:
                            continue  # it would run the tile fallback, not itself
                        if time.perf_counter() - t_start > budget_s:
                            skipped += 1
                            continue
                        try:
                            exact = torch.equal(int8_gemm(a, w, a_s, ws, r, config=cfg), ref)
                            t = bench_stream(
                                lambda w, cfg=cfg: int8_gemm(a, w, a_s, ws, r, config=cfg), copies
                            )
                        except Exception as e:  # noqa: BLE001 - one candidate's failure is data
                            failed.append(f"{model} {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                            torch.cuda.synchronize()
                            continue
                        if not exact:
                            mismatches.append(f"{model} {name} M={m} {cfg}")
                        cands[str(cfg)] = dict(
                            ms=t, tops=ops / t / 1e9, gbps=nbytes / t / 1e6, bit_equal=exact
                        )
                exact_c = {c: v["ms"] for c, v in cands.items() if v["bit_equal"]}
                best = min(exact_c, key=exact_c.get) if exact_c else str(table_cfg)
                best_ms = exact_c[best] if exact_c else t_table
                rows.append(
                    dict(
                        model=model, name=name, n=n, k=k, m=m, uses_per_step=uses,
                        table=str(table_cfg), table_ms=t_table, table_bit_equal=table_exact,
                        table_tops=ops / t_table / 1e9, table_gbps=nbytes / t_table / 1e6,
                        intmm_ms=t_intmm, candidates=cands, best=best, best_ms=best_ms,
                        floor_ms=nbytes / HBM_BYTES_PER_S * 1e3,
                    )
                )  # fmt: skip
                print(
                    f"{model:3s} {name:13s} N={n:6d} K={k:5d} M={m:5d}  table {str(table_cfg):24s}"
                    f" {t_table * 1e3:8.1f} us {ops / t_table / 1e9:6.0f} TOP/s"
                    f" {nbytes / t_table / 1e6:5.0f} GB/s"
                    f" exact={table_exact}  best {best:24s} {best_ms * 1e3:8.1f} us"
                    f" ({ops / best_ms / 1e9:5.0f} TOP/s {nbytes / best_ms / 1e6:5.0f} GB/s)"
                    + (f"  _int_mm {t_intmm * 1e3:.1f} us" if t_intmm else ""),
                    flush=True,
                )
            if partial_out:
                with open(partial_out, "w") as f:
                    json.dump(
                        dict(gemm=dict(rows=rows, proposal=propose(rows), partial=True, failed=failed)), f
                    )
    out = dict(rows=rows, proposal=propose(rows), skipped_candidates=skipped, mismatches=mismatches,
               failed=failed, sweep_s=time.perf_counter() - t_start)  # fmt: skip
    print_summary(out)
    return out


def propose(rows: list[dict]) -> dict:
    """Per M: the one config with the least decode-step-weighted time over every linear that
    timed all candidates (the per-M table), and each linear's own best (the per-shape table)."""
    by_m: dict[int, dict[str, float]] = {}
    complete: dict[int, list[dict]] = {}
    for r in rows:
        if not r["candidates"]:
            continue
        complete.setdefault(r["m"], []).append(r)
    for m, rs in complete.items():
        common = set.intersection(*(set(c for c, v in r["candidates"].items() if v["bit_equal"]) for r in rs))
        by_m[m] = {c: sum(r["uses_per_step"] * r["candidates"][c]["ms"] for r in rs) for c in common}
    per_m = {m: min(v, key=v.get) for m, v in by_m.items() if v}
    per_shape = {f"{r['model']} {r['name']} {r['n']}x{r['k']} M={r['m']}": r["best"] for r in rows}
    return dict(per_m=per_m, per_m_weighted_ms=by_m, per_shape=per_shape)


def print_summary(out: dict) -> None:
    rows = out["rows"]
    print("\n# decode/prefill GEMM time per forward (sum over the model's linears x uses):")
    print(f"  {'model':5s} {'M':>5s} {'table ms':>9s} {'best ms':>9s} {'HBM floor ms':>12s}  table TOP/s")
    for model in dict.fromkeys(r["model"] for r in rows):
        for m in dict.fromkeys(r["m"] for r in rows if r["model"] == model):
            rs = [r for r in rows if r["model"] == model and r["m"] == m]
            t = sum(r["uses_per_step"] * r["table_ms"] for r in rs)
            b = sum(r["uses_per_step"] * r["best_ms"] for r in rs)
            f = sum(r["uses_per_step"] * r["floor_ms"] for r in rs)
            ops = sum(r["uses_per_step"] * 2.0 * r["m"] * r["n"] * r["k"] for r in rs)
            print(f"  {model:5s} {m:5d} {t:9.3f} {b:9.3f} {f:12.3f}  {ops / t / 1e9:8.0f}")
    print_streamk_comparison(rows)
    print("# proposed config per M (step-weighted over all swept linears):")
    for m, c in sorted(out["proposal"]["per_m"].items()):
        print(f"  M={m:5d}  {c}")
    print(f"# sweep {out['sweep_s']:.0f} s, {out['skipped_candidates']} candidates skipped (budget),"
          f" {len(out['mismatches'])} bit mismatches: {out['mismatches'][:5]}")  # fmt: skip
    failed = out.get("failed", [])
    print(f"# {len(failed)} candidate runs failed" + "".join(f"\n  {f}" for f in failed[:8]))


def print_streamk_comparison(rows: list[dict]) -> None:
    """Per linear and M: the shipped table's config against the best stream-K and the best
    other candidate (us per call), then the step sums (ms): the sweep's old-vs-new verdict."""

    def best(r: dict, sk: bool) -> tuple[str, float] | None:
        c = {k: v["ms"] for k, v in r["candidates"].items() if v["bit_equal"] and ("/sk" in k) == sk}
        return min(c.items(), key=lambda kv: kv[1]) if c else None

    swept = [r for r in rows if r["candidates"]]
    if not any(best(r, True) for r in swept):
        return
    print("\n# stream K against the shipped table and the other candidates (us per call):")
    head = f"{'table':>8s} {'best other':>32s} {'best stream-K':>34s} {'floor':>7s}"
    print(f"  {'model':5s} {'linear':13s} {'M':>4s} {head}")
    sums: dict[tuple[str, int], list[float]] = {}
    for r in swept:
        o, k = best(r, False), best(r, True)
        if o is None or k is None:
            continue
        print(
            f"  {r['model']:5s} {r['name']:13s} {r['m']:4d} {r['table_ms'] * 1e3:8.1f}"
            f" {o[0]:>24s} {o[1] * 1e3:7.1f} {k[0]:>26s} {k[1] * 1e3:7.1f} {r['floor_ms'] * 1e3:7.1f}"
        )
        acc = sums.setdefault((r["model"], r["m"]), [0.0] * 5)
        u = r["uses_per_step"]
        for i, t in enumerate((r["table_ms"], o[1], k[1], min(o[1], k[1]), r["floor_ms"])):
            acc[i] += u * t
    head = f"{'table ms':>9s} {'best other':>10s} {'best sk':>8s} {'best':>8s} {'floor':>7s}"
    print(f"  {'model':5s} {'M':>4s} {head}")
    for (model, m), (t, o, k, b, f) in sums.items():
        print(f"  {model:5s} {m:4d} {t:9.3f} {o:10.3f} {k:8.3f} {b:8.3f} {f:7.3f}")


def attention_case(b: int, prefix: int, nh: int = 24, nkv: int = 4, hd: int = 256, tlen: int = 32):
    """A decode step's attention inputs at the 27B head shape: each of b rows has its own
    `prefix`-key ancestor piece and its own thought buffer holding tlen + 1 keys."""
    from engine.kernels.decode_rows import LIVE, ROW_FIELDS, THOUGHT_LEN

    gen = torch.Generator(device=DEVICE).manual_seed(4)
    cap = tlen + 1
    per_row = 2 * nkv * hd * (prefix + cap)
    base = torch.randn(b * per_row, device=DEVICE, generator=gen)
    pieces = torch.zeros(b, 4, 4, dtype=torch.int64)
    for r in range(b):
        o = r * per_row
        kv_pre, kv_own = nkv * hd * prefix, nkv * hd * cap
        pieces[r, 0] = torch.tensor([o, o + kv_pre, prefix, prefix])
        pieces[r, 3] = torch.tensor([o + 2 * kv_pre, o + 2 * kv_pre + kv_own, 0, cap])
    rows = torch.zeros(b, ROW_FIELDS, dtype=torch.int64)
    rows[:, LIVE] = 1
    rows[:, THOUGHT_LEN] = tlen
    q = torch.randn(b, nh, hd, device=DEVICE, generator=gen) * 0.1
    qg = torch.randn(b, nh * 2 * hd, device=DEVICE, generator=gen)
    kv_bytes = b * 2 * nkv * hd * 4 * (prefix + cap)
    return q, qg, base, rows.to(DEVICE), pieces.to(DEVICE), nkv, kv_bytes


def decode_attention_rows() -> list[dict]:
    """Decode attention, one pass (splits=1) against the prefix split (SPLITS), in a CUDA graph:
    ms per layer and K/V read rate; the two must agree to fp32 rounding (different fold order)."""
    from engine.kernels.decode_attention import SPLITS, decode_attention

    rows = []
    for b, prefix in [(1, 512), (1, 8192), (16, 512), (64, 512), (64, 2048)]:
        q, qg, base, trows, pieces, nkv, kv_bytes = attention_case(b, prefix)
        out = {}
        for splits in (1, SPLITS):
            t = bench_stream(
                lambda _, splits=splits: decode_attention(
                    q, qg, base, trows, pieces, num_kv_heads=nkv, splits=splits
                ),
                [base],
            )
            out[splits] = (t, decode_attention(q, qg, base, trows, pieces, num_kv_heads=nkv, splits=splits))
        diff = ((out[1][1] - out[SPLITS][1]).abs().max() / out[1][1].abs().max()).item()
        t1, ts = out[1][0], out[SPLITS][0]
        rows.append(
            dict(kind="decode_attention", rows=b, prefix=prefix, one_pass_ms=t1, split_ms=ts,
                 splits=SPLITS, kv_gbps=kv_bytes / ts / 1e6, rel_diff=diff)
        )  # fmt: skip
        print(
            f"decode attention {b:3d} rows x {prefix:5d} keys  one pass {t1 * 1e3:8.1f} us"
            f"  split {SPLITS} {ts * 1e3:8.1f} us ({kv_bytes / ts / 1e6:5.0f} GB/s K/V)"
            f"  max rel diff {diff:.1e}",
            flush=True,
        )
    return rows


def quant_rows() -> list[dict]:
    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for m in [64, 1024, 4096]:
        for k, fused in [(5120, True), (17408, False)]:
            x = torch.randn(m, k, device=DEVICE, generator=gen) * 3
            vec = torch.rand(k, device=DEVICE, generator=gen) + 0.5
            if fused:
                t = bench(lambda x=x, vec=vec: rms_norm_quantize(x, vec, 1e-6))
                ref = bench(lambda x=x, vec=vec: rms_norm_quantize_reference(x, vec, 1e-6))
                q, s = rms_norm_quantize(x, vec, 1e-6)
                q_r, s_r = rms_norm_quantize_reference(x, vec, 1e-6)
            else:
                t = bench(lambda x=x, vec=vec: quantize_rows(x, vec))
                ref = bench(lambda x=x, vec=vec: quantize_rows_reference(x, vec))
                q, s = quantize_rows(x, vec)
                q_r, s_r = quantize_rows_reference(x, vec)
            match = (q == q_r).float().mean().item()
            s_match = (s == s_r).float().mean().item()
            name = "norm+quant" if fused else "quant/div"
            rows.append(
                dict(kind=name, m=m, k=k, ms=t, torch_ms=ref, q_exact_frac=match, scale_exact_frac=s_match)
            )
            print(
                f"{name:10s} M={m:4d} K={k:5d}  triton {t:7.4f} ms  torch {ref:7.4f} ms"
                f"  q exact {match:.6f}  scale exact {s_match:.4f}",
                flush=True,
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write all rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="skip the GEMM config sweep")
    parser.add_argument("--gemm-only", action="store_true", help="only the GEMM sweep")
    parser.add_argument("--models", default="27B,4B", help="GEMM sweep: model shapes, comma separated")
    parser.add_argument("--m", default=",".join(map(str, SWEEP_M)), help="GEMM sweep: row counts")
    parser.add_argument(
        "--budget-s", type=float, default=180.0, help="GEMM sweep: skip candidates after this"
    )
    parser.add_argument("--preflight", action="store_true", help="run each GEMM candidate once, then exit")
    parser.add_argument(
        "--jobs", type=int, default=8, help="GEMM sweep: compile its configs in N processes first (1: no)"
    )
    parser.add_argument("--attention", action="store_true", help="only decode attention, 1 vs SPLITS splits")
    parser.add_argument(
        "--skip-ws", action="store_true", help="GEMM sweep: leave out warp-specialized configs"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}",
        flush=True,
    )
    if args.preflight:
        return preflight(args.skip_ws)
    if args.attention:
        rows = decode_attention_rows()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(rows=rows), f, indent=1)
        return 0
    rows = [] if args.gemm_only else quant_rows()
    if args.jobs > 1:
        precompile(args.models.split(","), [int(x) for x in args.m.split(",")], args.jobs, args.skip_ws)
    gemm = gemm_sweep(
        args.models.split(","),
        [int(x) for x in args.m.split(",")],
        args.budget_s,
        not args.quick,
        partial_out=args.out + ".partial" if args.out else None,
        skip_ws=args.skip_ws,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, gemm=gemm), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
