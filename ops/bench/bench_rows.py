"""Time the body's and decoder's memory-bound row kernels at the 27B shapes, config by config (CUDA only).

    PYTHONPATH=. python3 ops/bench/bench_rows.py [--out rows.json] [--rows 8192,1,64,256] [--quick]
        [--budget-s S] [--kernels swiglu+quant,...]
    python3 ops/bench/bench_rows.py --resources     # no GPU needed: SwiGLU variants' sm_90 registers

The kernels between the GEMMs - RMSNorm + int8 quantization (K = 5,120), plain quantization over
the SmoothQuant divisor (K = 6,144, the attention output), RMSNorm alone (5,120), SwiGLU +
quantization over the divisor (K = 17,408) and the forest's causal conv + SiLU (C = 10,240) -
move little data per row but run ~450 times a forward. Each kernel runs at its default (first:
the bits every other variant is checked against) and at other settings, all in one run, each
timed inside a CUDA graph (`triton.testing.do_bench_cudagraph`: no launch overhead, as in the
engine's captured passes): the row kernels on their long-row path too (`RESIDENT_VALUES = 0`:
the row re-read in each pass, what runs past the resident kernel's registers), SwiGLU at other
blocks / warps / loads ahead / register caps, with its loads kept in order
(`RESIDENT_ORDERED`), and as the recompute split (`RECOMPUTE_*`: two launches, v computed again
instead of stored), the conv at other tilings; the MLP's v (K = 17,408) quantized over the
divisor by `quantize_rows` (session 21's "v by absmax", a stream given each row's absmax, went with
the two-GEMM SwiGLU in session 27: commit 9f4898b has it). Every variant's outputs are checked
equal, bit for bit, to the default's (a variant that changes bits is reported, never chosen).
GB/s counts the bytes each kernel must read and write once (per-channel vectors, read by every
row from L2, not counted). The last lines are a table: us per call of the default and of the
fastest variant, per size. Sizes run in the order given; with --budget-s, no new size starts
after S seconds (the table still prints), so a device call with a time limit keeps what it
measured. --kernels runs only the named kernels (the names of the table's first column).
--resources compiles each SwiGLU variant for sm_90 at 256 rows (here, without a GPU: Triton's
ptxas) and prints registers per thread, local memory (stack + spills) and how many programs
of it an SM holds by registers.
"""

# Every closure below is timed inside the loop iteration that made it, so late binding is moot.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import engine.kernels.decode_quant as dq
import engine.kernels.forest_gdn as fg
import engine.kernels.norm as kn
import engine.kernels.quant as kq
from engine.kernels.forest_tables import ROW_FIELDS, SEG_FIELDS

ROWS = (8192, 1, 64, 256)  # the bandwidth-bound size first: a run cut short has it
HIDDEN, ATTN_OUT, INTER, CONV_C, CONV_W = 5120, 6144, 17408, 10240, 4
GDN_HEADS, GDN_DV = 48, 128

# variant name -> module settings; the first of each kernel is the default (empty: the module as
# it is), the bits every other one is checked against. Every other variant sets each knob it
# is named by, so its name stays true whatever the defaults become.
ROW_VARIANTS: dict[str, dict[str, Any]] = {
    "resident (default)": {},
    "long-row": {"RESIDENT_VALUES": 0},
    "w ahead": {"NORM_WEIGHT_AHEAD": True},
    "w behind": {"NORM_WEIGHT_AHEAD": False},
    # other blockings of the norm's sum: other bits (the sum's order), reported, never chosen here
    "n1024x8": {"NORM_BLOCKING": (1024, 8)},
    "n2048x8": {"NORM_BLOCKING": (2048, 8)},
    "n1024x4 r40": {"NORM_BLOCKING": (1024, 4), "RESIDENT_VALUES": 40},
    "n2048x4 r48": {"NORM_BLOCKING": (2048, 4), "RESIDENT_VALUES": 48},
    "n512x4 r40": {"NORM_BLOCKING": (512, 4), "RESIDENT_VALUES": 40},
    "n512x2 r80": {"NORM_BLOCKING": (512, 2), "RESIDENT_VALUES": 80},
}
_SWIGLU_DEFAULT = (
    f"{'ord' if dq.RESIDENT_ORDERED else 'res'} {dq.RESIDENT_BLOCK}x{dq.RESIDENT_WARPS} a{dq.RESIDENT_AHEAD}"
    f"{'' if dq.RESIDENT_MAXNREG is None else f' r{dq.RESIDENT_MAXNREG}'} (default)"
)
_SWIGLU_LONG = f"long-row {dq.LONG_ROW_BLOCK}x{dq.LONG_ROW_WARPS} u{dq.LONG_ROW_UNROLL}"
_CONV_DEFAULT = f"{fg.CONV_BLOCK_T}x{fg.CONV_BLOCK_C}x{fg.CONV_WARPS} g{fg.CONV_GENERAL_ROWS} (default)"


def _resident(
    block: int, warps: int, ahead: int, maxnreg: int | None = None, *, ordered: bool = False
) -> dict[str, Any]:
    """A resident-kernel variant at every row count (the split form off), with RESIDENT_VALUES
    raised where the 27B row needs more values a thread than the default holds (512 x 4: 136)."""
    need = -(-INTER // block) * block // (32 * warps)
    return dict(
        RESIDENT_BLOCK=block, RESIDENT_WARPS=warps, RESIDENT_AHEAD=ahead, RESIDENT_MAXNREG=maxnreg,
        RESIDENT_ORDERED=ordered, RESIDENT_VALUES=max(dq.RESIDENT_VALUES, need), SPLIT_MAX_ROWS=0,
    )  # fmt: skip


def _recompute(chunk: int, warps: int, *, hints: bool = True, reverse: bool = True) -> dict[str, Any]:
    """The recompute split (v computed again in the second launch, not stored) at every row count."""
    return dict(
        RECOMPUTE_ROWS=(1, 1 << 30), RECOMPUTE_CHUNK=chunk, RECOMPUTE_WARPS=warps,
        RECOMPUTE_L2_HINTS=hints, RECOMPUTE_REVERSE=reverse,
    )  # fmt: skip


def _conv(bt: int, bc: int, warps: int, bg: int) -> dict[str, Any]:
    return dict(CONV_BLOCK_T=bt, CONV_BLOCK_C=bc, CONV_WARPS=warps, CONV_GENERAL_ROWS=bg)


# "res": the resident kernel as ptxas schedules it (RESIDENT_AHEAD is only the emitted order: its
# sm_90 SASS is the same at a2, a4, a6 and a9, so "res 2048x16 a9" against "a2" shows the noise);
# "ord": its loads kept in order (RESIDENT_ORDERED, AHEAD binding), rNNN a register cap (1024x8
# a1-a3 r128 and 512x4 a2 hold two programs an SM without spills, 512x4 r168 three and 2048x16
# r64 two with a few spills: `--resources`); "rec": the recompute split, chunk and warps ("nohint":
# no L2 eviction hints, "fwd": its second launch in program order, not reversed).
SWIGLU_VARIANTS: dict[str, dict[str, Any]] = {
    _SWIGLU_DEFAULT: {},
    _SWIGLU_LONG: {"RESIDENT_VALUES": 0, "SPLIT_MAX_ROWS": 0},
    "res 1024x8 a4": _resident(1024, 8, 4),  # the default until session 21
    "res 1024x8 a6 r128": _resident(1024, 8, 6, 128),
    "res 2048x16 a2": _resident(2048, 16, 2),
    "res 4096x32 a2": _resident(4096, 32, 2),
    "res 2048x16 a9": _resident(2048, 16, 9),
    "split 2048 w4": {"SPLIT_MAX_ROWS": 1 << 30, "SPLIT_CHUNK": 2048, "SPLIT_WARPS": 4},
    "split 1024 w4": {"SPLIT_MAX_ROWS": 1 << 30, "SPLIT_CHUNK": 1024, "SPLIT_WARPS": 4},
    "split 4096 w8": {"SPLIT_MAX_ROWS": 1 << 30, "SPLIT_CHUNK": 4096, "SPLIT_WARPS": 8},
    "res 512x4 a4": _resident(512, 4, 4),
    "ord 1024x8 a1 r128": _resident(1024, 8, 1, 128, ordered=True),
    "ord 1024x8 a2 r128": _resident(1024, 8, 2, 128, ordered=True),
    "ord 1024x8 a3 r128": _resident(1024, 8, 3, 128, ordered=True),
    "ord 1024x8 a2": _resident(1024, 8, 2, ordered=True),
    "ord 1024x8 a4": _resident(1024, 8, 4, ordered=True),
    "ord 2048x16 a1": _resident(2048, 16, 1, ordered=True),
    "ord 2048x16 a1 r64": _resident(2048, 16, 1, 64, ordered=True),
    "ord 512x4 a2": _resident(512, 4, 2, ordered=True),
    "ord 512x4 a2 r168": _resident(512, 4, 2, 168, ordered=True),
    "rec 1024 w4": _recompute(1024, 4),
    "rec 1024 w8": _recompute(1024, 8),
    "rec 2048 w8": _recompute(2048, 8),
    "rec 512 w4": _recompute(512, 4),
    "rec 1024 w4 nohint": _recompute(1024, 4, hints=False),
    "rec 1024 w4 fwd": _recompute(1024, 4, reverse=False),
}
CONV_VARIANTS: dict[str, dict[str, Any]] = {
    _CONV_DEFAULT: {},
    "16x128x4 g2": _conv(16, 128, 4, 2),
    "32x128x8 g4": _conv(32, 128, 8, 4),
    "64x128x8 g8": _conv(64, 128, 8, 8),
    "32x256x8 g4": _conv(32, 256, 8, 4),
}
# the MLP's v [M, 17,408] (the one-GEMM SwiGLU's) over the divisor: plain rows, any blocking the same bits
V_QUANT_VARIANTS: dict[str, dict[str, Any]] = {
    "rule (default)": {},
    "1024x8": {"PLAIN_BLOCKING": (1024, 8)},
    "2048x8": {"PLAIN_BLOCKING": (2048, 8)},
    "2048x16": {"PLAIN_BLOCKING": (2048, 16)},
    "4096x16": {"PLAIN_BLOCKING": (4096, 16)},
    "4096x32": {"PLAIN_BLOCKING": (4096, 32)},
    "long-row": {"RESIDENT_VALUES": 0},
}
# the GDN output gate (48 heads x 128 at 27B): per-head sums, so another warp count may move bits
# ("blocks": tiles of 16 heads on 4 warps keep the padded form's bits; 8 heads on 8 or 4 warps,
# 4 or 8 values a lane, sum in another order)
GATED_VARIANTS: dict[str, dict[str, Any]] = {
    "padded 4 warps (default)": {},
    "padded 8 warps": {"GATED_WARPS": 8},
    "blocks 16x4": {"GATED_FORM": "blocks", "GATED_BLOCK_HEADS": 16, "GATED_BLOCK_WARPS": 4},
    "blocks 16x4 z late": {
        "GATED_FORM": "blocks",
        "GATED_BLOCK_HEADS": 16,
        "GATED_BLOCK_WARPS": 4,
        "GATED_Z_AHEAD": False,
    },
    "blocks 8x2": {"GATED_FORM": "blocks", "GATED_BLOCK_HEADS": 8, "GATED_BLOCK_WARPS": 2},
    "blocks 8x8": {"GATED_FORM": "blocks", "GATED_BLOCK_HEADS": 8, "GATED_BLOCK_WARPS": 8},
    "blocks 8x4": {"GATED_FORM": "blocks", "GATED_BLOCK_HEADS": 8, "GATED_BLOCK_WARPS": 4},
    "blocks 16x8": {"GATED_FORM": "blocks", "GATED_BLOCK_HEADS": 16, "GATED_BLOCK_WARPS": 8},
}
QUICK = {"swiglu": 3, "conv": 3}  # --quick: the default and the next two variants


def timed(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=25))


@contextmanager
def settings(module: Any, values: dict[str, Any]) -> Iterator[None]:
    """The module's constants set to values for the block, restored after."""
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


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
    ap.add_argument("--rows", default=",".join(str(m) for m in ROWS))
    ap.add_argument("--quick", action="store_true", help="fewer SwiGLU and conv configs")
    ap.add_argument("--budget-s", type=float, default=0.0, help="start no new size after this (0: none)")
    ap.add_argument("--kernels", default="", help="only these kernels, e.g. swiglu+quant (default: all)")
    ap.add_argument("--resources", action="store_true", help="SwiGLU variants' sm_90 registers (no GPU)")
    args = ap.parse_args()
    if args.resources:
        resources(list(SWIGLU_VARIANTS.items()))
        return
    only = {name for name in args.kernels.split(",") if name}
    start = time.perf_counter()
    sizes = [int(m) for m in args.rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: dict = {"device": torch.cuda.get_device_name(), "rows": []}
    swiglu_variants = list(SWIGLU_VARIANTS.items())[: QUICK["swiglu"] if args.quick else None]
    conv_variants = list(CONV_VARIANTS.items())[: QUICK["conv"] if args.quick else None]

    def row(name: str, m: int, variant: str, ms: float, nbytes: int, same: bool) -> None:
        r = dict(kernel=name, m=m, variant=variant, us=1e3 * ms, gbps=nbytes / ms / 1e6, bit_equal=same)
        out["rows"].append(r)
        print(
            f"{name:<13} M={m:>5} {variant:<23} {1e3 * ms:9.2f} us {r['gbps']:7.0f} GB/s  bits={same}",
            flush=True,
        )
        if args.out:  # after each row: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)

    def compare(name: str, m: int, module: Any, variants: list, fn: Callable[[], Any], nbytes: int) -> None:
        if only and name not in only:
            return
        want = None
        for variant, values in variants:
            with settings(module, values):
                got = fn()
                got = got if isinstance(got, tuple) else (got,)
                if want is None:
                    want = tuple(g.clone() for g in got)
                same = all(torch.equal(p, q) for p, q in zip(got, want, strict=True))
                row(name, m, variant, timed(fn), nbytes, same)

    quant = list(ROW_VARIANTS.items())
    for m in sizes:
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: M={m} and later sizes skipped", flush=True)
            break
        x = torch.randn(m, HIDDEN, device="cuda", generator=gen)
        wn = torch.rand(HIDDEN, device="cuda", generator=gen) + 0.5
        a = torch.randn(m, ATTN_OUT, device="cuda", generator=gen)
        div = torch.rand(ATTN_OUT, device="cuda", generator=gen) + 0.5
        # the stacked gate/up GEMM's output as stored: gate j at column 2j, up j at 2j + 1
        gu = torch.randn(m, 2 * INTER, device="cuda", generator=gen)
        sdiv = torch.rand(INTER, device="cuda", generator=gen) + 0.5
        compare("norm+quant", m, kq, quant, lambda: kq.rms_norm_quantize(x, wn, 1e-6), m * HIDDEN * 5)
        compare("quant/div", m, kq, quant[:4], lambda: kq.quantize_rows(a, div), m * ATTN_OUT * 5)
        compare("norm", m, kn, quant[:2], lambda: kn.norm_rows(x, wn, 1e-6), m * HIDDEN * 8)
        compare("swiglu+quant", m, dq, swiglu_variants, lambda: dq.swiglu_quantize(gu, sdiv), m * INTER * 9)
        vq = list(V_QUANT_VARIANTS.items())
        o = torch.randn(m, GDN_HEADS, GDN_DV, device="cuda", generator=gen)
        z = torch.randn(m, GDN_HEADS * GDN_DV, device="cuda", generator=gen)
        wg = torch.rand(GDN_DV, device="cuda", generator=gen) + 0.5
        gdiv = torch.rand(GDN_HEADS * GDN_DV, device="cuda", generator=gen) + 0.5
        compare(
            "gated+quant", m, dq, list(GATED_VARIANTS.items()),
            lambda: dq.gated_norm_quantize(o, z, wg, gdiv, 1e-6), m * GDN_HEADS * GDN_DV * 9,
        )  # fmt: skip
        v = gu[:, 0::2].contiguous()  # [m, INTER], as the one-GEMM SwiGLU writes it
        compare("v quant/div", m, kq, vq, lambda: kq.quantize_rows(v, sdiv), m * INTER * 5)
        case = conv_case(m, gen)

        def conv() -> tuple[torch.Tensor, torch.Tensor]:
            return fg.forest_conv(**case), case["base"]

        compare("conv+silu", m, fg, conv_variants, conv, m * CONV_C * 8)
    summary(out["rows"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def resources(variants: list[tuple[str, dict[str, Any]]], m: int = 256) -> None:
    """Each SwiGLU variant's kernels compiled for sm_90 at m rows of the 27B row (`engine.kernels.
    aot`: no GPU, triton's own ptxas): registers per thread, local memory bytes (stack + spills)
    and programs an SM holds by its 65,536 registers (a warp's registers allocated in 256s; at
    most 64 warps), so which configs run two programs an SM without spilling is known before
    the GPU run."""
    import os

    os.environ.pop("TRITON_INTERPRET", None)
    from engine.kernels.aot import compile_launch, record

    print(f"{'variant':<23} {'kernel':<28} {'warps':>5} {'regs':>5} {'local B':>7} {'progs/SM':>8}")
    for variant, values in variants:
        with settings(dq, values), record() as launches:
            dq.swiglu_quantize(torch.zeros(m, 2 * INTER), torch.zeros(INTER))
        for launch in launches:
            got = compile_launch(launch)
            warps = int(launch.meta.get("num_warps", 4))
            per_warp = -(-(got.registers or 0) * 32 // 256) * 256
            progs = min(65536 // max(per_warp * warps, 1), 64 // warps)
            regs, local = str(got.registers), str(got.local_bytes)
            print(f"{variant:<23} {got.name:<28} {warps:>5} {regs:>5} {local:>7} {progs:>8}", flush=True)


def summary(rows: list[dict]) -> None:
    """us per call: the default / the fastest variant (its speed-up) per kernel and size; the
    fastest variant at the largest size named; any bit mismatch named."""
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    sizes = sorted(dict.fromkeys(r["m"] for r in rows))
    print("\nus per call, default / fastest variant (x speed-up); fastest variant at the largest size")
    head = "".join(f"{'M=' + str(m):>26}" for m in sizes)
    print(f"{'kernel':<13}{head}   fastest at M={sizes[-1]}")
    for k in kernels:
        line = f"{k:<13}"
        for m in sizes:
            rs = [r for r in rows if r["kernel"] == k and r["m"] == m]
            if not rs:
                line += f"{'-':>26}"
                continue
            default, best = rs[0]["us"], min(r["us"] for r in rs)
            line += f"{f'{default:.1f} / {best:.1f} ({default / best:.2f}x)':>26}"
        last = [r for r in rows if r["kernel"] == k and r["m"] == sizes[-1]]
        if last:
            best_row = min(last, key=lambda r: r["us"])
            line += f"   {best_row['variant']} {best_row['us']:.1f} us {best_row['gbps']:.0f} GB/s"
        print(line)
    bad = [r for r in rows if not r["bit_equal"]]
    print(f"bit mismatches: {len(bad)}")
    for r in bad:
        print(f"  {r['kernel']} M={r['m']} {r['variant']}")


if __name__ == "__main__":
    main()
