"""Time the engine's Triton kernels against their torch counterparts at 27B shapes (CUDA only).

    PYTHONPATH=. python3 ops/bench/bench_kernels.py [--out results.json] [--quick]

Medians of `triton.testing.do_bench` on random data; prints one table. The GEMM section also
sweeps a few fixed configs (all give identical bits: int32 accumulation is exact) to keep
engine.kernels.int8_gemm.CONFIG_TABLE honest.
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

SWEEP = [
    GemmConfig(64, 128, 128, 4, 4),
    GemmConfig(64, 256, 128, 8, 3),
    GemmConfig(128, 128, 128, 8, 3),
    GemmConfig(128, 256, 128, 8, 3),
    GemmConfig(128, 128, 128, 4, 4),
    GemmConfig(64, 128, 128, 4, 4, split_k=2),  # split K: more programs for decode's small M
    GemmConfig(64, 128, 128, 4, 4, split_k=4),
    GemmConfig(64, 64, 128, 4, 4, split_k=4),
    # persistent, TMA operands (sm_90 compile: ops/bench/NOTES-kernels.md, session 4)
    GemmConfig(128, 128, 128, 8, 3, persistent=True),
    GemmConfig(128, 256, 128, 8, 3, persistent=True),
    GemmConfig(64, 256, 128, 8, 4, persistent=True),
]


def bench(fn, rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def gemm_rows(quick: bool) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n in [(5120, 34816), (17408, 5120)]:
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=gen)
        w_bf = w.to(torch.bfloat16)
        ws = torch.rand(n, device="cuda", generator=gen) * 0.01
        for m in [1, 16, 64, 256, 1024, 4096]:
            a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda", generator=gen)
            a_bf = a.to(torch.bfloat16)
            a_s = torch.rand(m, device="cuda", generator=gen) * 0.05
            ops = 2.0 * m * n * k
            exact = torch.equal(int8_gemm(a, w, a_s, ws), int8_gemm_reference(a, w, a_s, ws))
            t_intmm = bench(lambda a=a: torch._int_mm(a, w.t()))
            t_intmm_epi = bench(
                lambda a=a, a_s=a_s: (torch._int_mm(a, w.t()).float() * a_s[:, None]) * ws[None, :]
            )
            t_bf16 = bench(lambda a_bf=a_bf: a_bf @ w_bf.t())
            t_table = bench(lambda a=a, a_s=a_s: int8_gemm(a, w, a_s, ws))
            sweep = {}
            table_out = int8_gemm(a, w, a_s, ws)
            if not quick:
                for cfg in SWEEP:
                    if not torch.equal(int8_gemm(a, w, a_s, ws, config=cfg), table_out):
                        raise AssertionError(f"{cfg} changed the bits at M={m}")  # int32 is exact
                    sweep[str(cfg)] = bench(
                        lambda a=a, a_s=a_s, cfg=cfg: int8_gemm(a, w, a_s, ws, config=cfg), rep=50
                    )
            best = min(sweep, key=sweep.get) if sweep else str(config_for(m))
            rows.append(
                dict(
                    kind="gemm", k=k, n=n, m=m, bitwise_equal_reference=exact,
                    intmm_ms=t_intmm, intmm_epilogue_ms=t_intmm_epi, bf16_ms=t_bf16, triton_ms=t_table,
                    intmm_tops=ops / t_intmm / 1e9, triton_tops=ops / t_table / 1e9,
                    bf16_tflops=ops / t_bf16 / 1e9,
                    table_config=str(config_for(m)), sweep_ms=sweep, best=best,
                    best_tops=ops / min(sweep.values()) / 1e9 if sweep else None,
                )
            )  # fmt: skip
            print(
                f"gemm K={k:5d} N={n:5d} M={m:4d}  _int_mm {ops / t_intmm / 1e9:6.0f} TOP/s"
                f"  _int_mm+epi {t_intmm_epi:7.3f} ms  triton {t_table:7.3f} ms"
                f" ({ops / t_table / 1e9:6.0f} TOP/s)  bf16 {ops / t_bf16 / 1e9:5.0f}  exact={exact}",
                flush=True,
            )
            if sweep:
                print("    sweep: " + ", ".join(f"{c[10:]}={v:.3f}" for c, v in sweep.items()), flush=True)
    return rows


def quant_rows() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(3)
    for m in [64, 1024, 4096]:
        for k, fused in [(5120, True), (17408, False)]:
            x = torch.randn(m, k, device="cuda", generator=gen) * 3
            vec = torch.rand(k, device="cuda", generator=gen) + 0.5
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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}",
        flush=True,
    )
    rows = quant_rows() + gemm_rows(args.quick)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
