"""Time the body's and decoder's memory-bound row kernels at the 27B shapes (CUDA only).

    PYTHONPATH=. python3 ops/bench/bench_rows.py [--out rows.json]

The kernels between the GEMMs - RMSNorm + int8 quantization (K = 5,120), plain quantization
(K = 6,144, the attention output), SwiGLU + quantization (K = 17,408), the GDN output gate +
quantization (48 x 128) and the forest's causal conv + SiLU (C = 10,240) - move little data
per row but run ~450 times a forward. Each is timed inside a CUDA graph
(`triton.testing.do_bench_cudagraph`: no launch overhead, as in the engine's captured passes)
at M = 1, 64, 256, 8,192 rows, for the launch parameters named on the command line (module
constants, e.g. the passes' unroll factor or the conv's blocks), and every variant's output is
checked equal, bit for bit, to the shipped parameters' (a variant that changes bits is reported,
never chosen). GB/s counts the bytes each kernel must read and write once.
"""

# Every closure below is timed inside the loop iteration that made it, so late binding is moot.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json

import torch

import engine.kernels.decode_quant as dq
import engine.kernels.forest_gdn as fg
import engine.kernels.quant as kq
from engine.kernels.forest_tables import ROW_FIELDS, SEG_FIELDS

ROWS = (1, 64, 256, 8192)
HIDDEN, ATTN_OUT, INTER, HV, DV, CONV_C, CONV_W = 5120, 6144, 17408, 48, 128, 10240, 4


def timed(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=50))


def conv_case(t: int, gen: torch.Generator) -> dict:
    """One live segment of t tokens from no parent: the shape of (a) and (c)'s evidence."""
    dev = "cuda"
    rows = torch.zeros(t, ROW_FIELDS, dtype=torch.int64)
    rows[:, 1] = torch.arange(t)
    rows[:, 2] = 1
    segs = torch.zeros(1, SEG_FIELDS, dtype=torch.int64)
    segs[0, 1] = t  # tok_lo 0, length t, level 0, no state in, conv tail written at offset 0
    segs[0, 7] = 1
    return dict(
        x=torch.randn(t, CONV_C, device=dev, generator=gen),
        weight=torch.randn(CONV_C, CONV_W, device=dev, generator=gen) * 0.5,
        base=torch.zeros(CONV_C * (CONV_W - 1) + 16, device=dev),
        rows=rows.to(dev),
        segs=segs.to(dev),
        conv_src=torch.zeros(1, CONV_W - 1, 2, dtype=torch.int64, device=dev),
        layer_off=0,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--unroll", default="1,4", help="row passes' unroll factors to time")
    ap.add_argument(
        "--swiglu", default="4096x8,8192x8,8192x16,4096x16", help="SwiGLU block x warps to time (unroll 4)"
    )
    ap.add_argument("--conv", default="16x128x4,32x128x4,64x64x4,64x128x8,32x256x8,16x256x4",
                    help="conv blocks BTxBCxwarps to time")  # fmt: skip
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: dict = {"device": torch.cuda.get_device_name(), "rows": []}

    def row(name: str, m: int, variant: str, ms: float, nbytes: int, same: bool) -> None:
        r = dict(kernel=name, m=m, variant=variant, us=1e3 * ms, gbps=nbytes / ms / 1e6, bit_equal=same)
        out["rows"].append(r)
        print(
            f"{name:<14} M={m:>5} {variant:<12} {1e3 * ms:9.2f} us {r['gbps']:7.0f} GB/s  bits={same}",
            flush=True,
        )

    unrolls = [int(u) for u in args.unroll.split(",")]
    shipped = (kq.UNROLL, dq.UNROLL)
    for m in ROWS:
        x = torch.randn(m, HIDDEN, device="cuda", generator=gen)
        wn = torch.rand(HIDDEN, device="cuda", generator=gen) + 0.5
        a = torch.randn(m, ATTN_OUT, device="cuda", generator=gen)
        div = torch.rand(ATTN_OUT, device="cuda", generator=gen) + 0.5
        g = torch.randn(m, INTER, device="cuda", generator=gen)
        u = torch.randn(m, INTER, device="cuda", generator=gen)
        o = torch.randn(m, HV, DV, device="cuda", generator=gen)
        z = torch.randn(m, HV * DV, device="cuda", generator=gen)
        cases = {
            "norm+quant": (lambda: kq.rms_norm_quantize(x, wn, 1e-6), m * HIDDEN * 5),
            "quant/div": (lambda: kq.quantize_rows(a, div), m * ATTN_OUT * 5),
            "swiglu+quant": (lambda: dq.swiglu_quantize(g, u, None), m * INTER * 9),
            "gated+quant": (lambda: dq.gated_norm_quantize(o, z, wn[:DV], None, 1e-6), m * HV * DV * 9),
        }
        want = {name: fn() for name, (fn, _) in cases.items()}
        for unroll in unrolls:
            kq.UNROLL = dq.UNROLL = unroll
            for name, (fn, nbytes) in cases.items():
                got = fn()
                same = all(torch.equal(p, q) for p, q in zip(got, want[name], strict=True))
                row(name, m, f"unroll {unroll}", timed(fn), nbytes, same)
        kq.UNROLL, dq.UNROLL = shipped
        shipped_swiglu = (dq.SWIGLU_BLOCK, dq.SWIGLU_WARPS)
        for spec in args.swiglu.split(","):
            dq.SWIGLU_BLOCK, dq.SWIGLU_WARPS = (int(v) for v in spec.split("x"))
            fn, nbytes = cases["swiglu+quant"]
            got = fn()
            same = all(torch.equal(p, q) for p, q in zip(got, want["swiglu+quant"], strict=True))
            row("swiglu+quant", m, spec, timed(fn), nbytes, same)
        dq.SWIGLU_BLOCK, dq.SWIGLU_WARPS = shipped_swiglu
    shipped_conv = (fg.BLOCK_T, fg.BLOCK_S, fg.BLOCK_C, fg.NUM_WARPS)
    for t in (1, 64, 256, 8192):
        case = conv_case(t, gen)
        want = fg.forest_conv(**case)
        for spec in args.conv.split(","):
            bt, bc, warps = (int(v) for v in spec.split("x"))
            fg.BLOCK_T, fg.BLOCK_S, fg.BLOCK_C, fg.NUM_WARPS = bt, bt, bc, warps  # the kernel needs BS = BT
            got = fg.forest_conv(**case)
            row(
                "conv+silu",
                t,
                spec,
                timed(lambda: fg.forest_conv(**case)),
                t * CONV_C * 8,
                torch.equal(got, want),
            )
        fg.BLOCK_T, fg.BLOCK_S, fg.BLOCK_C, fg.NUM_WARPS = shipped_conv
        if args.out:  # after each length: a run cut short keeps its rows
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
