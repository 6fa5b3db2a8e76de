"""The CUTLASS int8 GEMM (`engine/kernels/cutlass_gemm.py`) against the Triton tiles, per config.

For every 27B int8 linear as the engine launches it (stacked inputs; "+res" adds the residual in
the epilogue) and every M: the Triton kernel the table picks (`backend="triton"`; the MLP's
gate+up with its fused SwiGLU where `SWIGLU_TABLE` fuses, marked "swiglu"), then each CUTLASS
config, cold weights inside CUDA graphs (`bench_kernels.bench_stream`). Every CUTLASS output is
compared bit for bit with the Triton kernel's fp32 output (the plain GEMM's, also for gate+up).
Step sums weight each linear by its uses in one pass. Build the library first (`make cutlass`;
`python ops/build_cutlass.py --candidates` for every candidate config) and carry `.cache/cutlass`
to the GPU machine.

    python3 ops/bench/bench_cutlass.py [--candidates] --m 64,256,384,1024,8192 --json OUT.json

`--pairs` times the MLP's one-GEMM SwiGLU instead (`Library.swiglu_pairs` over the interleaved
gate+up weight, v only) per config, its v compared bit for bit with Triton's fused kernel's: which
tile the engine's `cutlass_gemm.swiglu_config` should name.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import bench_stream, model_linears  # noqa: E402

from engine.kernels import cutlass_gemm  # noqa: E402
from engine.kernels.int8_gemm import int8_gemm, int8_gemm_swiglu, swiglu_config_for  # noqa: E402


def randint8(shape: tuple[int, int], dev: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-127, 128, shape, dtype=torch.int8, device=dev, generator=gen)


def time_linear(
    lib: cutlass_gemm.Library,
    configs: tuple[cutlass_gemm.CutlassConfig, ...],
    m: int,
    name: str,
    n: int,
    k: int,
    copies_bytes: int,
) -> dict:
    """One linear at one M: Triton's time, each config's time and whether its bits match."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(m * 7 + n)
    copies = max(2, min(16, copies_bytes // (n * k)))
    ws = [randint8((n, k), dev, gen) for _ in range(copies)]
    a = randint8((m, k), dev, gen)
    a_scale = torch.rand(m, device=dev, generator=gen) + 0.5
    w_scale = torch.rand(n, device=dev, generator=gen) + 0.5
    res = torch.randn(m, n, device=dev, generator=gen) if name.endswith(("+res", "+c")) else None
    want = int8_gemm(a, ws[0], a_scale, w_scale, res, backend="triton")
    row: dict = {"m": m, "linear": name, "n": n, "k": k}
    if name == "mlp_gate_up" and swiglu_config_for(m) is not None:
        row["triton_kind"] = "swiglu"
        row["triton_ms"] = bench_stream(lambda w: int8_gemm_swiglu(a, w, a_scale, w_scale), ws)
    else:
        row["triton_kind"] = "gemm"
        row["triton_ms"] = bench_stream(
            lambda w: int8_gemm(a, w, a_scale, w_scale, res, backend="triton"), ws
        )
    y = torch.empty(m, n, device=dev)
    for c in configs:
        lib.gemm(c.name, a, ws[0], a_scale, w_scale, res, y)
        same = bool(torch.equal(y, want))
        t = bench_stream(lambda w, c=c: lib.gemm(c.name, a, w, a_scale, w_scale, res, y), ws)
        row[c.name] = {"ms": t, "same_bits": same}
    return row


def time_pairs(
    lib: cutlass_gemm.Library,
    configs: tuple[cutlass_gemm.CutlassConfig, ...],
    m: int,
    n: int,
    k: int,
    copies_bytes: int,
) -> dict:
    """The one-GEMM SwiGLU at M rows of the interleaved weight [n, k]: Triton's fused kernel (its v
    the bit oracle) and each config's `swiglu_pairs`, cold weights in CUDA graphs."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(m * 11 + n)
    ws = [randint8((n, k), dev, gen) for _ in range(max(2, min(16, copies_bytes // (n * k))))]
    a = randint8((m, k), dev, gen)
    a_scale = torch.rand(m, device=dev, generator=gen) * 0.02 + 1e-3
    w_scale = torch.rand(n, device=dev, generator=gen) * (1.0 / k) + 1e-4
    want = int8_gemm_swiglu(a, ws[0], a_scale, w_scale, backend="triton")
    row: dict = {"m": m, "linear": "mlp_gate_up pairs", "n": n, "k": k}
    row["triton_ms"] = bench_stream(lambda w: int8_gemm_swiglu(a, w, a_scale, w_scale, backend="triton"), ws)
    v = torch.empty(m, n // 2, device=dev)
    for c in configs:
        lib.swiglu_pairs(c.name, a, ws[0], a_scale, w_scale, v)
        same = bool(torch.equal(v, want))
        t = bench_stream(lambda w, c=c: lib.swiglu_pairs(c.name, a, w, a_scale, w_scale, v), ws)
        row[c.name] = {"ms": t, "same_bits": same}
    return row


def linears_at(model: str, m: int) -> list[tuple[str, int, int, int]]:
    """`model_linears` as the engine launches them at M rows: without the LM head (read-out rows
    only). The MLP's gate+up is one GEMM at every M (from `cutlass_gemm.SWIGLU_MIN_ROWS` rows the
    one-GEMM SwiGLU, which writes v, half the plain GEMM's output: timed here as the plain GEMM)."""
    return [(name, n, k, uses) for name, n, k, uses in model_linears(model) if name != "lm_head"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="64,256,384,1024,8192")
    ap.add_argument("--model", default="27B")
    ap.add_argument("--copies-bytes", type=int, default=256 << 20, help="weights cycled per graph (cold L2)")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--candidates", action="store_true", help="every candidate (ops/build_cutlass.py --candidates)"
    )
    ap.add_argument("--configs", default=None, help="with --candidates: only these (comma list of names)")
    ap.add_argument(
        "--pairs", action="store_true", help="the MLP's one-GEMM SwiGLU per config, not the linears"
    )
    args = ap.parse_args()
    configs = cutlass_gemm.candidates(args.configs) if args.candidates else cutlass_gemm.CONFIGS
    path = cutlass_gemm.default_library(configs)
    if not path.exists() or torch.cuda.get_device_capability() != (9, 0):
        build = "python ops/build_cutlass.py [--candidates [--configs ...]]"
        raise SystemExit(f"needs an sm_90 GPU and {path}: {build}")
    lib = cutlass_gemm.Library(path, configs)
    names = [c.name for c in configs]
    rows, sums = [], {}
    if args.pairs:
        (n, k) = next((n, k) for name, n, k, _ in model_linears(args.model) if name == "mlp_gate_up")
        for m in [int(x) for x in args.m.split(",")]:
            row = time_pairs(lib, configs, m, n, k, args.copies_bytes)
            rows.append(row)
            line = f"M={m:5d} pairs N={n:6d} K={k:6d} triton {row['triton_ms'] * 1e3:7.1f}"
            for c in names:
                line += f" | {c} {row[c]['ms'] * 1e3:7.1f}{'' if row[c]['same_bits'] else ' BITS DIFFER'}"
            print(line, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "configs": names}, indent=1))
        return
    for m in [int(x) for x in args.m.split(",")]:
        total = dict.fromkeys(["triton", *names], 0.0)
        for name, n, k, uses in linears_at(args.model, m):
            row = time_linear(lib, configs, m, name, n, k, args.copies_bytes)
            row["uses"] = uses
            rows.append(row)
            total["triton"] += uses * row["triton_ms"]
            line = f"M={m:5d} {name:13s} N={n:6d} K={k:6d}"
            line += f" triton({row['triton_kind']}) {row['triton_ms'] * 1e3:7.1f}"
            for c in names:
                total[c] += uses * row[c]["ms"]
                line += f" | {c} {row[c]['ms'] * 1e3:7.1f}{'' if row[c]['same_bits'] else ' BITS DIFFER'}"
            print(line, flush=True)
        sums[m] = total
        print(f"M={m} step sums (ms):", {c: round(v, 2) for c, v in total.items()}, flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "step_sums_ms": sums, "configs": names}, indent=1)
        )


if __name__ == "__main__":
    main()
