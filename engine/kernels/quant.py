"""Per-row symmetric int8 quantization, alone or fused after an RMSNorm; one program per row.

    scale = absmax(v) / 127;  q = clamp(round_half_even(v / scale), -127, 127)   (scale 0 -> q 0)

where v is a row of x, optionally divided elementwise by a per-channel SmoothQuant divisor, or
(fused) rms_norm(x) * weight computed in fp32. Every row is reduced by one program with a
block size fixed by K alone, so a row's bits never depend on how many rows the call has.
The plain quantization uses only exact or correctly rounded steps (absmax is exact in any
order, division is IEEE `div_rn`, rounding and clamping are exact), so it equals the torch
reference bit for bit on any device. The fused norm's sum of squares is reduced in the
kernel's own fixed order and `rsqrt` is the hardware's, so it matches torch only to ~1 ulp
before rounding; what it guarantees is batch invariance.

A row that fits in RESIDENT_VALUES registers a thread (K <= 8,192 normed; plain K <= 16,384,
or <= 24,576 at WIDE_RESIDENT_VALUES) is loaded once, all its blocks in flight together, and kept
in registers across the passes (`_quant_resident_kernel`); a longer row is read once per pass
(`_quant_long_row_kernel`). Both compute the same blocks with the same operations (with a
norm, the same block and warps and so the same order of the sum): the same bits, so where the
line between them falls never changes a result. On the H200 the resident kernel was 2.6-3x
faster for the plain quantization and equal to 1.24x for the fused norm (bench_rows.py,
2026-12-02; ops/bench/NOTES-kernels.md).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels._triton import Backend, cdiv, helper, kernel, next_pow2, use_triton

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

INT8_MAX = 127
MAX_BLOCK = 4096
# The resident kernel holds at most this many fp32 values of a row per thread; a row past it
# (e.g. a normed 10,240 row at the norm's fixed 8 warps) runs the long-row kernel. 0 sends every
# row there (bench_rows.py times the two kernels that way; the bits are the same).
RESIDENT_VALUES = 32
# A plain row no warp count holds at RESIDENT_VALUES may still be held at 16 warps with up to
# this many a thread (0: never; nor when RESIDENT_VALUES is 0): the 17,408 row of the
# SwiGLU-fused MLP path (v, then quantize_rows).
# H200, 27B, bits equal: 24.3 -> 15.3 us at 256 rows, 549 -> 434 at 8,192 (bench_swiglu.py,
# 2026-12-02 session 9). Shorter rows keep the fewest warps that hold 32 values a thread.
WIDE_RESIDENT_VALUES = 48
# Those 16-warp rows take blocks of at least this many values: 4 a thread, so each block is one
# 16-byte load a thread (1,024 gave 2, 8-byte loads). H200, 27B's 17,408-wide v over the divisor
# (bench_rows.py "v quant/div", 2026-12-04 session 15; the same bits): 8,192 rows 358 -> 294 us,
# 256 rows 14.2 -> 12.0 us (2,048 x 8 warps: 353 / 14.2, the row past 48 values a thread: 290 /
# 13.4; 4,096 x 16: 487 / 17.2).
WIDE_MIN_BLOCK = 2048
# The resident kernel loads the norm's weight with the row (before the sum of squares) instead
# of after the sum: one dependent memory round trip less per row. Same bits either way. H200,
# 27B's 5,120 row (bench_rows.py "w ahead" / "w behind", 2026-12-04 session 14): 1 row 6.2 ->
# 5.7 us, 256 rows 8.0 -> 7.5, 8,192 rows 140.6 -> 139.5. (Making the normed values again for
# the quantize pass instead of keeping them, to free registers, measured no faster.)
NORM_WEIGHT_AHEAD = True
# (BLOCK, warps) for every plain row instead of `resident_blocking`'s rule (None: the rule). Plain
# rows sum nothing (absmax is exact in any order, the codes elementwise), so any blocking gives
# the same bits: a knob for bench_rows.py's variants.
PLAIN_BLOCKING: tuple[int, int] | None = None
# A normed row's blocks hold at most this many values a thread (`pass_blocking`): one 16-byte load
# each, and a sum of squares that is mostly each lane's own adds across blocks before the block's
# tree. H200, 27B's 5,120 row (bench_rows.py, 2026-12-04 session 15): blocks of 1,024 on 8 warps
# against the former 4,096 (2 blocks, 16 values a thread, a quarter of the lanes masked in the
# second): 8,192 rows 139.8 -> 62.8 us (1.5 -> 3.3 TB/s), 256 rows 7.49 -> 4.26 us; 2,048 x 8
# 81.5 / 5.4, 1,024 x 4 64.5 / 4.8, 512 x 4 70.9 / 4.6. The block fixes the sum's order, so
# this moved the norm's bits (once; still one rule for every batch and both kernels).
NORM_BLOCK_VALUES = 4
# (BLOCK, warps) instead of `pass_blocking`'s rule (None: the rule). Unlike PLAIN_BLOCKING this
# one moves bits: it fixes the order of the norm's sum of squares. For bench_rows.py's variants.
NORM_BLOCKING: tuple[int, int] | None = None
# The long-row kernel's passes unrolled this many blocks (same ops, same order, same bits).
# Measured on the H200 (bench_rows.py, 2026-12-01, then the only kernel): unrolling 4 made no
# difference at one row and cost 33-60% at 8,192 rows, so the passes stay rolled.
LONG_ROW_UNROLL = 1
# 1.5 * 2^23: adding and subtracting it rounds an fp32 |r| < 2^22 to an integer, ties to even
_RINT_MAGIC = 12582912.0


def _quant_long_row_kernel(
    x_ptr, div_ptr, w_ptr, q_ptr, s_ptr,
    K, stride_x, stride_q, eps,
    HAS_DIV: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """A row too long for `_quant_resident_kernel`'s registers: the same blocks and operations,
    the row re-read (from L2) in each pass instead of kept."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)

    inv = 1.0
    if NORM:
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK, loop_unroll_factor=UNROLL):
            x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            sq += x * x
        mean = tl.math.div_rn(tl.sum(sq, axis=0), K.to(tl.float32))
        inv = tl.math.rsqrt(mean + eps)

    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK, loop_unroll_factor=UNROLL):
        v, m = _row_block(x_row, w_ptr, div_ptr, k0, offs, K, inv, NORM, HAS_DIV)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.math.div_rn(tl.max(amax, axis=0), 127.0)
    safe = tl.where(scale > 0, scale, 1.0)

    for k0 in tl.range(0, K, BLOCK, loop_unroll_factor=UNROLL):
        v, m = _row_block(x_row, w_ptr, div_ptr, k0, offs, K, inv, NORM, HAS_DIV)
        tl.store(q_row + k0 + offs, _round_int8(tl.math.div_rn(v, safe), ON_GPU), mask=m)
    tl.store(s_ptr + row, scale)


def _row_block(x_row, w_ptr, div_ptr, k0, offs, K, inv, NORM: tl.constexpr, HAS_DIV: tl.constexpr):
    """The long-row kernel's block at k0: loaded, its `_row_value`, and its mask."""
    m = k0 + offs < K
    x = tl.load(x_row + k0 + offs, mask=m, other=0.0).to(tl.float32)
    w = 1.0  # unread without a norm
    if NORM:
        w = _norm_weight(w_ptr, k0, offs, K)
    return _row_value(x, w, div_ptr, k0, offs, K, inv, NORM, HAS_DIV), m


def _round_int8(r, ON_GPU: tl.constexpr):
    """v / scale to int8: rounded half to even (the hardware's rint, or the magic-number add
    the interpreter's numpy does in fp32 alike), clamped to +-127. Every quantizing kernel
    rounds with this, so the same quotient gives the same code everywhere."""
    r = libdevice.rint(r) if ON_GPU else r + _RINT_MAGIC - _RINT_MAGIC
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


def _quant_resident_kernel(
    x_ptr, div_ptr, w_ptr, q_ptr, s_ptr,
    K, stride_x, stride_q, eps,
    HAS_DIV: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
    WEIGHT_AHEAD: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """One row, read once: its NB = cdiv(K, BLOCK) blocks are loaded together (all loads in
    flight at once, one memory latency instead of one per block and pass) and kept in registers
    across the passes (sum of squares if NORM, absmax, quantize). The sum of squares accumulates
    per lane in block order, then `tl.sum` over [BLOCK]: `_quant_long_row_kernel`'s order.
    WEIGHT_AHEAD loads the norm's weight with the row, before the sum, instead of after it (the
    same values and operations: the same bits)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK)

    xs = ()
    ws = ()
    for b in tl.static_range(NB):
        m = b * BLOCK + offs < K
        xs = xs + (tl.load(x_row + b * BLOCK + offs, mask=m, other=0.0).to(tl.float32),)
        if NORM and WEIGHT_AHEAD:
            ws = ws + (_norm_weight(w_ptr, b * BLOCK, offs, K),)

    inv = 1.0
    if NORM:
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for b in tl.static_range(NB):
            sq += xs[b] * xs[b]
        mean = tl.math.div_rn(tl.sum(sq, axis=0), K.to(tl.float32))
        inv = tl.math.rsqrt(mean + eps)

    vs = ()
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in tl.static_range(NB):
        w = 1.0  # unread without a norm
        if NORM:
            if WEIGHT_AHEAD:  # noqa: SIM108 - a constexpr branch (ws is empty without it)
                w = ws[b]
            else:
                w = _norm_weight(w_ptr, b * BLOCK, offs, K)
        v = _row_value(xs[b], w, div_ptr, b * BLOCK, offs, K, inv, NORM, HAS_DIV)
        amax = tl.maximum(amax, tl.abs(v))
        vs = vs + (v,)
    scale = tl.math.div_rn(tl.max(amax, axis=0), 127.0)
    safe = tl.where(scale > 0, scale, 1.0)

    for b in tl.static_range(NB):
        m = b * BLOCK + offs < K
        tl.store(q_row + b * BLOCK + offs, _round_int8(tl.math.div_rn(vs[b], safe), ON_GPU), mask=m)
    tl.store(s_ptr + row, scale)


def _norm_weight(w_ptr, k0, offs, K):
    """The norm's weight over the block at k0, fp32."""
    return tl.load(w_ptr + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)


def _row_value(x, w, div_ptr, k0, offs, K, inv, NORM: tl.constexpr, HAS_DIV: tl.constexpr):
    """The values v of the block at k0 of a row from its inputs x (fp32): rms-normed (x * inv)
    and weighted by w (`_norm_weight`'s block) if NORM, over the SmoothQuant divisor if HAS_DIV.
    Both kernels quantize these."""
    m = k0 + offs < K
    v = x
    if NORM:
        v = (v * inv) * w
    if HAS_DIV:
        v = tl.math.div_rn(v, tl.load(div_ptr + k0 + offs, mask=m, other=1.0).to(tl.float32))
    return v


_norm_weight = helper(_norm_weight)  # type: ignore[assignment]
_row_value = helper(_row_value)  # type: ignore[assignment]
_row_block = helper(_row_block)  # type: ignore[assignment]
_round_int8 = helper(_round_int8)  # type: ignore[assignment]
_resident = kernel(_quant_resident_kernel)
_long_row = kernel(_quant_long_row_kernel)


# ------------------------------------------------------------------------ torch references
def quantize_rows_reference(
    x: torch.Tensor, divisor: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch form of the kernel's quantization: (q int8 [M, K], scale fp32 [M]).

    Every step is exact or one correctly rounded fp32 division, so CPU and CUDA agree bit for bit.
    """
    v = x.float()
    if divisor is not None:
        v = v / divisor.float()
    return _codes_reference(v, v.abs().amax(dim=-1))


def _codes_reference(v: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch: v's rows quantized by their absmax (scale = amax / 127, q = clamp(round(v / scale)))."""
    # divide by a tensor, not the number 127: on CUDA torch turns division by a Python scalar
    # into a multiply by its rounded reciprocal, which is off by 1 ulp for ~4% of rows
    scale = amax / torch.full_like(amax, float(INT8_MAX))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(v / safe[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w in fp32, the value the fused kernel quantizes."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * weight.float()


def rms_norm_quantize_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows_reference(rms_norm_fp32(x, weight, eps))


# ------------------------------------------------------------------------ public API
def _check_rows(x: torch.Tensor, name: str, vec: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} expects x [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} expects a float32/bfloat16/float16 x, got {x.dtype}")
    if vec is not None:
        if vec.shape != (x.shape[1],):
            raise ValueError(f"{name}: per-channel vector must be [{x.shape[1]}], got {tuple(vec.shape)}")
        if vec.device != x.device:
            raise ValueError(f"{name}: per-channel vector is on {vec.device}, x on {x.device}")


def _launch(
    x: torch.Tensor, divisor: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q, scale = _codes_for(x)
    if not m or not k:
        return q, scale
    div = divisor.contiguous() if divisor is not None else scale  # unread placeholders
    wgt = weight.contiguous() if weight is not None else scale
    norm = weight is not None
    resident = resident_blocking(k, norm)
    if resident is not None:
        block, warps = resident
        _resident[(m,)](
            x, div, wgt,
            q, scale, k, x.stride(0), q.stride(0), float(eps),
            HAS_DIV=divisor is not None, NORM=norm, BLOCK=block, NB=cdiv(k, block),
            WEIGHT_AHEAD=NORM_WEIGHT_AHEAD, num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
        return q, scale
    block, warps = pass_blocking(k)
    _long_row[(m,)](
        x, div, wgt,
        q, scale, k, x.stride(0), q.stride(0), float(eps),
        HAS_DIV=divisor is not None, NORM=norm, BLOCK=block, UNROLL=LONG_ROW_UNROLL,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return q, scale


def _codes_for(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs (q int8 [M, K], scale fp32 [M]) of quantizing x's rows, uninitialized, except
    that rows of no values get scale 0 (a kernel launch over K = 0 writes nothing)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    return q, (scale if k else scale.zero_())


def pass_blocking(k: int) -> tuple[int, int]:
    """(BLOCK, warps) of the long-row kernel for rows of k, and of the resident kernel with a
    norm: one rule, because they fix the order of the norm's sum of squares."""
    if NORM_BLOCKING is not None:
        return NORM_BLOCKING
    block = min(next_pow2(k), MAX_BLOCK)
    warps = 8 if block >= 2048 else 4
    return min(block, NORM_BLOCK_VALUES * 32 * warps), warps


def resident_blocking(k: int, norm: bool) -> tuple[int, int] | None:
    """(BLOCK, warps) of the resident kernel for rows of k, or None where the row does not fit
    in RESIDENT_VALUES registers a thread (the long-row kernel runs it then).

    With a norm, the block and warps are the long-row kernel's: they fix the order in which the
    sum of squares is reduced (lanes across blocks, then `tl.sum` over the block's layout), so
    they are not free. Without one nothing is summed (absmax is exact in any order), so the
    block is the power of two that pads k least (6,144 = 3 x 2,048, 5,120 = 5 x 1,024, not
    2 x 4,096 with a half-empty second block) and the warps the fewest that fit the row.
    """
    if norm:
        block, warps = pass_blocking(k)
        return (block, warps) if cdiv(k, block) * block <= RESIDENT_VALUES * 32 * warps else None
    if PLAIN_BLOCKING is not None and RESIDENT_VALUES:
        return PLAIN_BLOCKING
    block = min(next_pow2(k), MAX_BLOCK)
    for b in (MAX_BLOCK, 2048, 1024, 512, 256):
        if b < block and cdiv(k, b) * b < cdiv(k, block) * block:
            block = b
    for warps in (4, 8, 16):
        if cdiv(k, block) * block <= RESIDENT_VALUES * 32 * warps:
            return block, warps
    # at 16 warps, blocks of at least WIDE_MIN_BLOCK: 4 values a thread, one 16-byte load each
    block = max(block, WIDE_MIN_BLOCK)
    if RESIDENT_VALUES and cdiv(k, block) * block <= WIDE_RESIDENT_VALUES * 32 * 16:
        return block, 16
    return None


def quantize_rows(
    x: torch.Tensor, divisor: torch.Tensor | None = None, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 of x [M, K] (optionally x / divisor[K] first): (q int8 [M, K], scale fp32 [M])."""
    _check_rows(x, "quantize_rows", divisor)
    if not use_triton(backend, x):
        return quantize_rows_reference(x, divisor)
    return _launch(x, divisor, None, 0.0)


def rms_norm_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused RMSNorm(x) * weight (fp32) then per-row int8: (q int8 [M, K], scale fp32 [M])."""
    _check_rows(x, "rms_norm_quantize", weight)
    if not eps > 0:
        raise ValueError(f"rms_norm_quantize needs eps > 0, got {eps}")
    if not use_triton(backend, x):
        return rms_norm_quantize_reference(x, weight, eps)
    return _launch(x, None, weight, eps)
