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


def linears_at(model: str, m: int) -> list[tuple[str, int, int, int]]:
    """`model_linears` as the engine launches them at M rows: without the LM head (read-out rows
    only), and where the MLP takes the two-GEMM SwiGLU form (`cutlass_gemm.swiglu_serves`) its
    gate+up as two GEMMs of half the width each (the up projection, then the gate's whose
    epilogue reads it as C: timed here as a GEMM with a residual, the same bytes)."""
    out = []
    for name, n, k, uses in model_linears(model):
        if name == "lm_head":
            continue
        if name == "mlp_gate_up" and cutlass_gemm.swiglu_serves(m):
            out.append(("mlp_half+c", n // 2, k, 2 * uses))
        else:
            out.append((name, n, k, uses))
    return out


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
    args = ap.parse_args()
    configs = cutlass_gemm.candidates(args.configs) if args.candidates else cutlass_gemm.CONFIGS
    path = cutlass_gemm.default_library(configs)
    if not path.exists() or torch.cuda.get_device_capability() != (9, 0):
        build = "python ops/build_cutlass.py [--candidates [--configs ...]]"
        raise SystemExit(f"needs an sm_90 GPU and {path}: {build}")
    lib = cutlass_gemm.Library(path, configs)
    names = [c.name for c in configs]
    rows, sums = [], {}
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
