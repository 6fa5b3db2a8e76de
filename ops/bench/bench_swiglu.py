"""The MLP's gate+up GEMM and SwiGLU, unfused against fused, at the 27B and 4B shapes (CUDA only).

    PYTHONPATH=. python3 ops/bench/bench_swiglu.py [--out swiglu.json] [--m 1,16,64,256,384,1024,8192]
        [--models 27B,4B] [--budget-s S]

Old: the stacked gate+up `int8_gemm` (over the interleaved weight, the stored layout) writes fp32
[M, 2I], `swiglu_quantize` reads it back for ffn_down's int8 rows. New: `int8_gemm_swiglu` writes v
= silu(gate) * up fp32 [M, I] and `quantize_rows(v, smooth)` quantizes it. Per (model, M): the old
pair, the new pair at the shipped SWIGLU_TABLE config (None there: the engine keeps the old pair at
that M) and at every SWIGLU_CANDIDATES config, each timed inside a CUDA graph with the weight
cycled through copies that do not fit in L2 (`bench_kernels.bench_stream`, as the GEMM sweep times
the linears); the pieces (GEMM alone, quantizer alone) at the table config too. Every new pair's
(q, scale) is checked bit for bit against the old pair's: a mismatch is reported and never
proposed. The last lines: per model and M, old us, best new us and its config, ms saved per forward
(x the layers), and a proposed SWIGLU_TABLE (a fused config only where it beats the old pair by
more than --margin). Both models at the 7 row counts: ~1-2 minutes on an H200 (compiles included).
Where the CUTLASS library serves M, also its one-GEMM SwiGLU at any M (`SWIGLU_MIN_ROWS` 0), and
from SWIGLU_MIN_ROWS the engine's call (`int8_gemm_swiglu_quantize`) on the table's tile against
the swizzled one where the table clusters (`SWIGLU_SWIZZLE`).
"""

# Every lambda below is timed inside the loop iteration that made it, so late binding is moot.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from bench_kernels import L2_FLUSH_BYTES, bench_stream

import engine.kernels.quant as kq
from engine.kernels import cutlass_gemm
from engine.kernels.decode_quant import swiglu_quantize
from engine.kernels.int8_gemm import (
    SWIGLU_CANDIDATES,
    GemmConfig,
    int8_gemm,
    int8_gemm_swiglu,
    int8_gemm_swiglu_quantize,
    swiglu_config_for,
)
from engine.kernels.quant import quantize_rows

MODELS = {"27B": (5120, 17408, 64), "4B": (2560, 9216, 32)}  # hidden, intermediate, layers
ROWS = (1, 16, 64, 256, 384, 1024, 8192)
DEVICE = "cuda"  # module-level so a CPU smoke run of the bookkeeping can swap it


def _old(a, w, a_s, w_s, div):
    return swiglu_quantize(int8_gemm(a, w, a_s, w_s), div)


def _new(a, w, a_s, w_s, div, cfg: GemmConfig | None):
    return quantize_rows(int8_gemm_swiglu(a, w, a_s, w_s, config=cfg), div)


@contextmanager
def _setting(module, name: str, value) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _same(x: tuple[torch.Tensor, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def run(models: list[str], rows: list[int], budget_s: float) -> dict:
    t_start = time.perf_counter()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    out: list[dict] = []
    mismatches: list[str] = []
    skipped = 0
    for model in models:
        hidden, inter, layers = MODELS[model]
        w = torch.randint(-127, 128, (2 * inter, hidden), dtype=torch.int8, device=DEVICE, generator=gen)
        w_s = torch.rand(2 * inter, device=DEVICE, generator=gen) * (2.0 / hidden) + 1e-5
        div = torch.rand(inter, device=DEVICE, generator=gen) + 0.5
        copies = [w] + [w.clone() for _ in range(-(-L2_FLUSH_BYTES // w.numel()) - 1)]
        for m in rows:
            a = torch.randint(-127, 128, (m, hidden), dtype=torch.int8, device=DEVICE, generator=gen)
            a_s = torch.rand(m, device=DEVICE, generator=gen) * 0.02 + 1e-3
            want = _old(a, w, a_s, w_s, div)
            t_old = bench_stream(lambda w: _old(a, w, a_s, w_s, div), copies)
            y = int8_gemm(a, w, a_s, w_s)
            t_old_gemm = bench_stream(lambda w: int8_gemm(a, w, a_s, w_s), copies)
            t_old_quant = bench_stream(lambda w: swiglu_quantize(y, div), [w])
            table = swiglu_config_for(m)
            row = dict(model=model, m=m, hidden=hidden, inter=inter, layers=layers, old_us=t_old * 1e3,
                       old_gemm_us=t_old_gemm * 1e3, old_swiglu_quant_us=t_old_quant * 1e3,
                       table=str(table) if table else None)  # fmt: skip
            if table is not None:
                row["table_bit_equal"] = _same(_new(a, w, a_s, w_s, div, None), want)
                row["table_us"] = bench_stream(lambda w: _new(a, w, a_s, w_s, div, None), copies) * 1e3
                v = int8_gemm_swiglu(a, w, a_s, w_s)
                row["table_gemm_us"] = bench_stream(lambda w: int8_gemm_swiglu(a, w, a_s, w_s), copies) * 1e3
                row["table_quant_us"] = bench_stream(lambda w: quantize_rows(v, div), [w]) * 1e3
                # where the CUTLASS library serves M: its one-GEMM SwiGLU at any M
                # (`cutlass_gemm.SWIGLU_MIN_ROWS` 0) beside the table's row and the old pair
                row["cutlass_swiglu_us"] = None
                if cutlass_gemm.serves(a, w, None, torch.float32):
                    with _setting(cutlass_gemm, "SWIGLU_MIN_ROWS", 0):
                        row["cutlass_swiglu_bit_equal"] = _same(_new(a, w, a_s, w_s, div, None), want)
                        t_one = bench_stream(lambda w: _new(a, w, a_s, w_s, div, None), copies)
                        row["cutlass_swiglu_us"] = t_one * 1e3
                    if not row["cutlass_swiglu_bit_equal"]:
                        mismatches.append(f"{model} M={m} cutlass swiglu")
                # the engine's call (`int8_gemm_swiglu_quantize`) where the one-GEMM form takes
                # M: on the table's tile and, where the table clusters, the swizzled one
                if cutlass_gemm.serves(a, w, None, torch.float32) and cutlass_gemm.swiglu_serves(m):
                    engine_call = lambda w: int8_gemm_swiglu_quantize(a, w, a_s, w_s, div)  # noqa: E731
                    for key, swizzle in (("pairs_table", False), ("pairs_swizzled", True)):
                        with _setting(cutlass_gemm, "SWIGLU_SWIZZLE", swizzle):
                            row[key + "_bit_equal"] = _same(engine_call(w), want)
                            row[key + "_us"] = bench_stream(engine_call, copies) * 1e3
                        if not row[key + "_bit_equal"]:
                            mismatches.append(f"{model} M={m} {key}")
                    print(
                        f"    M={m}: one GEMM + quantize_rows (table tile) {row['pairs_table_us']:8.1f} us, "
                        f"(swizzled where the table clusters) {row['pairs_swizzled_us']:8.1f} us",
                        flush=True,
                    )
                # quantize_rows holds a row in registers up to kq.RESIDENT_VALUES a thread (32:
                # 16,384 values at 16 warps), so the 27B's 17,408 takes its long-row kernel (v read
                # twice); the same at 48 (the same bits: quant.py), to see whether to raise it
                q_default = quantize_rows(v, div)
                with _setting(kq, "RESIDENT_VALUES", 48):
                    row["table_quant_resident48_bit_equal"] = _same(quantize_rows(v, div), q_default)
                    row["table_quant_resident48_us"] = (
                        bench_stream(lambda w: quantize_rows(v, div), [w]) * 1e3
                    )
                if not row["table_bit_equal"]:
                    mismatches.append(f"{model} M={m} table {table}")
            cands: dict[str, dict] = {}
            for cfg in SWIGLU_CANDIDATES:
                if cfg.block_m >= 4 * max(m, 16):
                    continue  # mostly padding rows
                if time.perf_counter() - t_start > budget_s:
                    skipped += 1
                    continue
                try:
                    exact = _same(_new(a, w, a_s, w_s, div, cfg), want)
                    t = bench_stream(lambda w, cfg=cfg: _new(a, w, a_s, w_s, div, cfg), copies)
                except Exception as e:  # noqa: BLE001 - one candidate's failure is data
                    cands[str(cfg)] = dict(failed=f"{type(e).__name__}: {str(e)[:200]}")
                    torch.cuda.synchronize()
                    continue
                if not exact:
                    mismatches.append(f"{model} M={m} {cfg}")
                cands[str(cfg)] = dict(us=t * 1e3, bit_equal=exact)
            row["candidates"] = cands
            exact_c = {c: v["us"] for c, v in cands.items() if v.get("bit_equal")}
            row["best"] = min(exact_c, key=exact_c.get) if exact_c else None
            row["best_us"] = exact_c[row["best"]] if exact_c else None
            out.append(row)
            table_txt = f"table {row['table'] or 'unfused':22s}" + (
                f" {row['table_us']:8.1f} us bits={row['table_bit_equal']}"
                + (f" (cutlass one-GEMM {row['cutlass_swiglu_us']:8.1f})" if row["cutlass_swiglu_us"] else "")
                if table
                else " " * 22
            )
            best_txt = f"best {row['best']} {row['best_us']:8.1f} us" if row["best"] else "no candidate"
            print(
                f"{model:3s} M={m:5d}  old {t_old * 1e3:8.1f} us (gemm {t_old_gemm * 1e3:7.1f} + swiglu "
                f"{t_old_quant * 1e3:6.1f})  {table_txt}  {best_txt}",
                flush=True,
            )
        del copies, w
        torch.cuda.empty_cache()
    return dict(
        rows=out, mismatches=mismatches, skipped_candidates=skipped, seconds=time.perf_counter() - t_start
    )


def summarize(result: dict, margin: float) -> dict:
    """Print per (model, M) the saving per forward and the proposed table; return the proposal
    (per M: the best bit-equal candidate over the models' summed time, if it beats the old pair
    by more than `margin` there, else None)."""
    print(
        "\nmodel     M    old us   table us    best us  best config                 saved ms/forward (best)"
    )
    for r in result["rows"]:
        table_us = r.get("table_us")
        best_us = r["best_us"]
        saved = (r["old_us"] - best_us) * r["layers"] / 1e3 if best_us else 0.0
        print(
            f"{r['model']:3s} {r['m']:7d} {r['old_us']:9.1f} {table_us if table_us else float('nan'):10.1f}"
            f" {best_us if best_us else float('nan'):10.1f}  {str(r['best']):26s} {saved:8.2f}"
        )
    proposal: dict[int, str | None] = {}
    for m in sorted({r["m"] for r in result["rows"]}):
        rs = [r for r in result["rows"] if r["m"] == m]
        old = sum(r["old_us"] * r["layers"] for r in rs)
        names = set.intersection(
            *[{c for c, v in r["candidates"].items() if v.get("bit_equal")} for r in rs]
        )  # fmt: skip
        sums = {c: sum(r["candidates"][c]["us"] * r["layers"] for r in rs) for c in names}
        best = min(sums, key=sums.get) if sums else None
        proposal[m] = best if best and sums[best] < old * (1 - margin) else None
        print(f"proposed SWIGLU_TABLE at M={m}: {proposal[m] or 'None (unfused)'}")
    if result["mismatches"]:
        print("MISMATCHES (fused != unfused bits):", *result["mismatches"], sep="\n  ")
    return proposal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows and the proposal as JSON here")
    parser.add_argument("--models", default="27B,4B", help="comma separated, of " + ",".join(MODELS))
    parser.add_argument("--m", default=",".join(map(str, ROWS)), help="row counts, comma separated")
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip candidates after this")
    parser.add_argument("--margin", type=float, default=0.02, help="propose fused only if this much faster")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_swiglu needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}",
        flush=True,
    )
    result = run(args.models.split(","), [int(x) for x in args.m.split(",")], args.budget_s)
    result["proposal"] = summarize(result, args.margin)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
