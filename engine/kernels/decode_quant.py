"""Fused float op + per-row int8 quantization for the decode step, one program per row.

- `gated_norm_quantize`: the GDN output gate, per value head rms_norm(o) * ssm_norm * silu(z),
  then the row quantized for `ssm_out` (divided by its SmoothQuant s first).
- `swiglu_quantize`: silu(gate) * up, then the row quantized for `ffn_down`, from the stacked
  gate+up GEMM's output as stored: gate and up interleaved (gate j at column 2j, up j at
  2j + 1), the layout that lets Hopper's one CUTLASS GEMM pair each gate with its up in one
  thread's registers (`cutlass_gemm`'s `swiglu_pairs`). Every form loads a block's gate and
  up pairs as one load and splits it (`_gate_up`).

Quantization is `engine.kernels.quant`'s: scale = absmax / 127 (IEEE division), q =
clamp(rint(v / scale), -127, 127). A row is reduced by one program with a block fixed by the
row length, so its bits never depend on how many rows the call has.

SwiGLU keeps a row's values in registers between the absmax and the quantizing pass
(`_swiglu_resident_kernel`, rows of up to RESIDENT_VALUES a thread: K <= 18,432; with
RESIDENT_ORDERED, on by default, its loads are kept in program order); a longer row
is read and computed twice (`_swiglu_long_row_kernel`); calls of at most SPLIT_MAX_ROWS rows
are cut into chunks, a program each (`_swiglu_chunk_kernel`, `_quant_chunk_kernel`). Calls
whose row count lies in RECOMPUTE_ROWS (off by default: a candidate for mid-size calls) are
cut into chunks too, but v is computed again from gate and up in the second launch instead of
being stored (`_swiglu_chunk_absmax_kernel`, `_swiglu_chunk_codes_kernel`). No sums, only
elementwise steps and an exact absmax, so every block, warp count and path gives the same
bits. On the H200 the resident kernel was 1.3-1.7x faster at the 27B row (bench_rows.py,
2026-12-02).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels._triton import Backend, cdiv, helper, kernel, next_pow2, use_triton
from engine.kernels.gate_up import split_gate_up
from engine.kernels.quant import _round_int8, quantize_rows_reference

tl: Any = None  # bound at first launch (engine.kernels._triton)

# SwiGLU + quantization, resident: 17,408 (27B) = 17 blocks of 1,024 over 8 warps (68 values a
# thread) with 4 blocks of gate and up in flight (sm_90, triton 3.6: 180 registers, no spills);
# 1.3-1.7x the long-row kernel's speed on the H200 (bench_rows.py, 2026-12-02). Rows past
# RESIDENT_VALUES a thread run the long-row kernel (0: every row does, as bench_rows.py times it).
# Rows shorter than RESIDENT_BLOCK take a block of their power of two on 4 warps.
RESIDENT_BLOCK = 1024
RESIDENT_WARPS = 8
RESIDENT_VALUES = 72
# Blocks of gate and up loaded ahead of the one being computed. In the default (unordered) form
# this is only the order Triton emits: ptxas schedules the loads itself, and the sm_90 SASS is
# the same at AHEAD 2, 4, 6 and 9 (gate's loads interleaved with the exps, then every up and
# divisor load at once: the 180 registers). RESIDENT_ORDERED makes it binding.
RESIDENT_AHEAD = 3
RESIDENT_MAXNREG: int | None = 128  # a register cap for ptxas (None: its own choice)
# Ordered loads: block b + AHEAD's gate, up and divisor loads are masked by a predicate computed
# (opaquely, always true) from the absmax after block b - 1, so neither LLVM nor ptxas can issue
# them earlier: AHEAD blocks in flight, not the whole row's up and divisor, so fewer registers
# (with RESIDENT_MAXNREG 128, two programs of 8 warps an SM). The same loads and values: the
# same bits. On since session 21 (H100, bench_rows.py --kernels swiglu+quant, 27B's 17,408 row,
# CUDA graphs, every variant bit-equal): ordered, 3 blocks ahead, capped at 128 registers, against
# the unordered 180-register kernel, 256 rows 18.33 -> 14.53 us, 384 rows 35.43 -> 31.57 (a1 / a2:
# 15.56 / 15.16 at 256; ordered but uncapped 23-24: the cap's second program an SM is the gain).
# 64-row calls take the split form either way (7.5 us; ordered and capped 9.6).
RESIDENT_ORDERED = True
# The long-row kernel: its passes unrolled 4 blocks, blocks of 4,096 on 16 warps. Measured on the
# H200 at 17,408 (bench_rows.py, 2026-12-01, then the only kernel), us per call at 1 / 64 / 8,192
# rows: rolled 8 warps 13.9 / 14.2 / 759; unrolled 4, 8 warps 13.0 / 13.4 / 638; unrolled 4,
# 16 warps 9.5 / 9.9 / 545 (block 8,192 was slower).
LONG_ROW_UNROLL = 4
LONG_ROW_BLOCK = 4096
LONG_ROW_WARPS = 16
# The gated norm's warps. H200, 27B's 48 x 128 row (bench_rows.py "gated+quant", 2026-12-04
# session 15): 4 warps against the former 8 (from 4,096 padded values a row) 320 -> 178 us at
# 8,192 rows, 11.9 -> 9.0 at 256; 16 warps 247 / 11.0. The same bits at all three there (each
# head's 128 values are summed inside one warp); the tests hold every count to the reference.
GATED_WARPS = 4
# The gated norm's layout of a row. "padded" holds it as one [next_pow2(HV), dv] tile on
# GATED_WARPS (27B: 64 x 128 for 48 heads, a quarter of the lanes masked but computed, 64 values
# of o and 64 of z a thread; z loaded after the sums). "blocks" holds it as cdiv(HV,
# GATED_BLOCK_HEADS) tiles of [GATED_BLOCK_HEADS, dv] on GATED_BLOCK_WARPS (27B: 3 tiles of 16
# heads x 128, 48 values of o and of z a thread), every tile of o and z loaded before the first
# sum, as the resident norm kernel does (`quant._quant_resident_kernel`: 3.3 TB/s at 8,192 rows
# of 5,120 on the H200, where the padded form moves its 452 MB in 178 us, 2.5 TB/s). The rest
# is elementwise and an exact absmax, so the bits rest on each head's sum of squares, whose order
# follows from the tile's layout: at dv 128 both forms lay a head over 8 lanes of 16 values
# (sizePerThread [1, 16], threadsPerWarp [4, 8]) wherever a tile holds at least 16 values a
# thread (GATED_BLOCK_HEADS >= 4 x warps): the padded form's bits, checked on the sm_90 layouts
# (`test_kernel_decode.py`) and on the GPU. Fewer values a thread (8 heads on 8 warps: 4 values
# a lane over 32 lanes, the resident norm's loads) is another order: other bits, still one rule
# for every batch. Built on the CPU, not yet timed: `bench_rows.py` "gated+quant" times them.
GATED_FORMS = ("padded", "blocks")
GATED_FORM = "padded"
GATED_BLOCK_HEADS = 16
GATED_BLOCK_WARPS = 4
# The blocks form loads z's tiles with o's, before the sums (sm_90, triton 3.9, 27B: 167
# registers, 3 programs an SM; the padded form 127, 4), or, False, each tile's z where the gate
# is applied (fewer registers, a second round trip): the same values and ops either way.
GATED_Z_AHEAD = True
# Calls of at most SPLIT_MAX_ROWS rows (the decoder's) run the split form: a row cut into chunks
# of SPLIT_CHUNK, one program each, in two launches (v and each chunk's absmax, then the row's
# scale and the chunk's codes), so a decode row is read by 17 programs instead of walked through
# its 17 blocks by one. The same elementwise ops and an exact absmax: the resident kernel's bits.
# H200, 27B row (bench_rows.py, 2026-12-04 session 14), us per call at 1 / 64 / 256 rows:
# resident 11.1 / 11.3 / 14.9, split 1,024 on 4 warps 3.9 / 7.1 / 22.1, split 2,048 6.9 / 9.7 /
# 25.8; the decoder's step at one sequence 96.8 -> 102.8 tokens/s with the 2,048 split.
SPLIT_MAX_ROWS = 64
SPLIT_CHUNK = 1024
SPLIT_WARPS = 4
# The recompute split, for calls of RECOMPUTE_ROWS = (lo, hi) rows, inclusive (None: never; it
# is tried before the split above, then the resident kernel): each row cut into chunks of
# RECOMPUTE_CHUNK values on RECOMPUTE_WARPS, one program per (row, chunk) in two launches. The
# first computes v and stores only the chunk's absmax; the second takes the row's scale from its
# chunks' absmax (exact in any order) and computes v again from gate and up to quantize it. Why:
# the resident kernel keeps 68 values a thread (180 registers: one program of 8 warps an SM, so
# an SM alternates between waiting on memory and on its division chains), and the stored split
# writes and reads v back (17.8 MB at 256 rows; 22.1 us there against the resident 14.9). Here a
# program holds one chunk, so an SM runs many (latency hidden by occupancy), and the second read
# of gate and up (35.6 MB at 256 rows) can come from the H200's 50 MB L2: pass 1 loads them
# evict-last, pass 2 evict-first and in reverse program order, so it starts on the data loaded
# last (RECOMPUTE_L2_HINTS, RECOMPUTE_REVERSE: speed only, not bits). v is computed by the same
# helper, elementwise ops and rounding as every other path: the resident kernel's bits.
# Measured (H100, session 21, bench_rows.py, 27B row): 256 rows 23.7 us (1,024 on 4 warps; the
# other chunks, warps and hints 24-26) against the resident kernel's 18.3 (14.5 ordered); 384
# rows 37.1-44.1 against 35.4; 64 rows 8.6-10.5 against the split's 7.5. Kept off.
RECOMPUTE_ROWS: tuple[int, int] | None = None
RECOMPUTE_CHUNK = 1024
RECOMPUTE_WARPS = 4
RECOMPUTE_L2_HINTS = True
RECOMPUTE_REVERSE = True


def _gated_norm_quant_kernel(
    o_ptr, z_ptr, w_ptr, div_ptr, q_ptr, s_ptr, stride_z, eps,
    HV: tl.constexpr, HP: tl.constexpr, DV: tl.constexpr, HAS_DIV: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, DV)
    idx = offs_h[:, None] * DV + offs_d[None, :]
    m = (offs_h[:, None] < HV) & (offs_d[None, :] < DV)
    o = tl.load(o_ptr + row * HV * DV + idx, mask=m, other=0.0)
    ms = tl.math.div_rn(tl.sum(o * o, axis=1), tl.full((HP,), DV, tl.float32))
    inv = tl.math.rsqrt(ms + eps)
    y = (o * inv[:, None]) * tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
    z = tl.load(z_ptr + row * stride_z + idx, mask=m, other=0.0).to(tl.float32)
    y = y * (z / (1.0 + tl.exp(-z)))
    if HAS_DIV:
        y = tl.math.div_rn(y, tl.load(div_ptr + idx, mask=m, other=1.0).to(tl.float32))
    y = tl.where(m, y, 0.0)
    scale = tl.math.div_rn(tl.max(tl.max(tl.abs(y), axis=1), axis=0), 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    r = tl.math.div_rn(y, tl.full((HP, DV), 1.0, tl.float32) * safe)
    tl.store(q_ptr + row * HV * DV + idx, _round_int8(r, ON_GPU), mask=m)
    tl.store(s_ptr + row, scale)


def _gated_norm_blocks_kernel(
    o_ptr, z_ptr, w_ptr, div_ptr, q_ptr, s_ptr, stride_z, eps,
    HV: tl.constexpr, HB: tl.constexpr, NB: tl.constexpr, DV: tl.constexpr, HAS_DIV: tl.constexpr,
    Z_AHEAD: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """The "blocks" form of `_gated_norm_quant_kernel` (`GATED_FORM`): one row as NB tiles of
    [HB heads, DV], the heads past HV masked. All tiles of o (and with Z_AHEAD of z) are loaded
    first, every load in flight at once, and kept in registers; then per tile the heads' norms,
    the gate and the divisor, in the padded kernel's operations and order; then the row's absmax
    and codes."""
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HB)
    offs_d = tl.arange(0, DV)
    idx = offs_h[:, None] * DV + offs_d[None, :]
    w = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
    os = ()
    zs = ()
    for b in tl.static_range(NB):
        m = (b * HB + offs_h[:, None] < HV) & (offs_d[None, :] < DV)
        os = os + (tl.load(o_ptr + row * HV * DV + b * HB * DV + idx, mask=m, other=0.0),)
        if Z_AHEAD:
            zs = zs + (_gate_tile(z_ptr, row, stride_z, b * HB * DV, idx, m),)
    ys = ()
    amax = tl.zeros((HB, DV), dtype=tl.float32)
    for b in tl.static_range(NB):
        m = (b * HB + offs_h[:, None] < HV) & (offs_d[None, :] < DV)
        o = os[b]
        ms = tl.math.div_rn(tl.sum(o * o, axis=1), tl.full((HB,), DV, tl.float32))
        inv = tl.math.rsqrt(ms + eps)
        y = (o * inv[:, None]) * w
        z = zs[b] if Z_AHEAD else _gate_tile(z_ptr, row, stride_z, b * HB * DV, idx, m)
        y = y * (z / (1.0 + tl.exp(-z)))
        if HAS_DIV:
            y = tl.math.div_rn(y, tl.load(div_ptr + b * HB * DV + idx, mask=m, other=1.0).to(tl.float32))
        y = tl.where(m, y, 0.0)
        amax = tl.maximum(amax, tl.abs(y))
        ys = ys + (y,)
    scale = tl.math.div_rn(tl.max(tl.max(amax, axis=1), axis=0), 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    for b in tl.static_range(NB):
        m = (b * HB + offs_h[:, None] < HV) & (offs_d[None, :] < DV)
        r = tl.math.div_rn(ys[b], tl.full((HB, DV), 1.0, tl.float32) * safe)
        tl.store(q_ptr + row * HV * DV + b * HB * DV + idx, _round_int8(r, ON_GPU), mask=m)
    tl.store(s_ptr + row, scale)


def _gate_tile(z_ptr, row, stride_z, at, idx, m):
    """The gate z's tile at column `at` of a row, fp32."""
    return tl.load(z_ptr + row * stride_z + at + idx, mask=m, other=0.0).to(tl.float32)


def _swiglu_resident_kernel(
    gu_ptr, div_ptr, q_ptr, s_ptr, K, stride_gu,
    HAS_DIV: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, AHEAD: tl.constexpr,
    ORDERED: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """One row, read once: the NB = cdiv(K, BLOCK) blocks' values v = silu(g) * u (/ div)
    stay in registers from the absmax pass to the quantizing one. Gate and up of block
    b + AHEAD are loaded before block b is computed; ptxas reorders them freely unless ORDERED
    (`_swiglu_resident_ordered`). The same elementwise ops on every element and an exact
    absmax: the same bits, whatever BLOCK, AHEAD, ORDERED and the warps are, and the long-row
    kernel's."""
    row = tl.program_id(0).to(tl.int64)
    if ORDERED:
        _swiglu_resident_ordered(gu_ptr, div_ptr, q_ptr, s_ptr, K, stride_gu, row,
                                 HAS_DIV, BLOCK, NB, AHEAD, ON_GPU)  # fmt: skip
    else:
        offs = tl.arange(0, BLOCK)
        gu_row = gu_ptr + row * stride_gu
        gs = ()
        us = ()
        for b in tl.static_range(AHEAD):
            if b < NB:
                k = b * BLOCK + offs
                g, u = _gate_up(gu_row, k, k < K, "")
                gs = gs + (g,)
                us = us + (u,)
        vs = ()
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for b in tl.static_range(NB):
            if b + AHEAD < NB:
                k = (b + AHEAD) * BLOCK + offs
                g, u = _gate_up(gu_row, k, k < K, "")
                gs = gs + (g,)
                us = us + (u,)
            m = b * BLOCK + offs < K
            g, u = gs[b].to(tl.float32), us[b].to(tl.float32)
            v = _swiglu_value(g, u, div_ptr, b * BLOCK, offs, m, HAS_DIV)
            amax = tl.maximum(amax, tl.where(m, tl.abs(v), 0.0))
            vs = vs + (v,)
        scale = tl.math.div_rn(tl.max(amax, axis=0), 127.0)
        safe = tl.where(scale > 0, scale, 1.0)
        for b in tl.static_range(NB):
            r = tl.math.div_rn(vs[b], tl.zeros((BLOCK,), dtype=tl.float32) + safe)
            tl.store(q_ptr + row * K + b * BLOCK + offs, _round_int8(r, ON_GPU), mask=b * BLOCK + offs < K)
        tl.store(s_ptr + row, scale)


def _swiglu_resident_ordered(
    gu_ptr, div_ptr, q_ptr, s_ptr, K, stride_gu, row,
    HAS_DIV: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, AHEAD: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """The resident kernel with its loads kept in order: block b + AHEAD's gate, up and divisor
    are loaded under a mask that is all true but known only once block b - 1's absmax is
    (`_after`), so ptxas cannot hoist them. Unordered, it issues every up and divisor load of
    the row at once (180 registers at 17,408 on 8 warps: one program an SM, which then waits on
    memory and on its division chains in turn); ordered, AHEAD blocks are in flight and the rest
    of the registers hold v (sm_90: AHEAD 2 fits 128 registers without spills, so two programs
    of 8 warps an SM overlap their phases). A block is [BLOCK / 4, 4], its gate and up pairs
    one [BLOCK / 4, 4, 2] load (`_gate_up`), and the dependence is one per block row (the max
    of its 4 absmax lanes), so it leaves the pair loads whole; a 1-D mask computed per value
    would split them into 4-byte loads.
    The values, their ops and the absmax (a max: exact in any order) are the unordered form's."""
    offs = tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]
    gu_row = gu_ptr + row * stride_gu
    gs = ()
    us = ()
    ds = ()
    for b in tl.static_range(AHEAD):
        if b < NB:
            k = b * BLOCK + offs
            g, u = _gate_up(gu_row, k, k < K, "")
            gs = gs + (g,)
            us = us + (u,)
            if HAS_DIV:
                ds = ds + (tl.load(div_ptr + k, mask=k < K, other=1.0),)
    vs = ()
    amax = tl.zeros((BLOCK // 4, 4), dtype=tl.float32)
    for b in tl.static_range(NB):
        if b + AHEAD < NB:
            k = (b + AHEAD) * BLOCK + offs
            m = k < K
            if ON_GPU and b > 0:
                m = m & _after(tl.max(amax, axis=1))[:, None]  # once block b - 1 is computed
            g, u = _gate_up(gu_row, k, m, "")
            gs = gs + (g,)
            us = us + (u,)
            if HAS_DIV:
                ds = ds + (tl.load(div_ptr + k, mask=m, other=1.0),)
        m = b * BLOCK + offs < K
        v = _silu_times(gs[b].to(tl.float32), us[b].to(tl.float32))
        if HAS_DIV:
            v = tl.math.div_rn(v, ds[b].to(tl.float32))
        amax = tl.maximum(amax, tl.where(m, tl.abs(v), 0.0))
        vs = vs + (v,)
    scale = tl.math.div_rn(tl.max(tl.max(amax, axis=1), axis=0), 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    for b in tl.static_range(NB):
        r = tl.math.div_rn(vs[b], tl.zeros((BLOCK // 4, 4), dtype=tl.float32) + safe)
        tl.store(q_ptr + row * K + b * BLOCK + offs, _round_int8(r, ON_GPU), mask=b * BLOCK + offs < K)
    tl.store(s_ptr + row, scale)


def _swiglu_long_row_kernel(
    gu_ptr, div_ptr, q_ptr, s_ptr, K, stride_gu,
    HAS_DIV: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """A row too long for `_swiglu_resident_kernel`'s registers: gate and up read, and v
    computed, once for the absmax and again to quantize (the second read mostly from L2)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK, loop_unroll_factor=UNROLL):
        v, m = _swiglu_block(gu_ptr, div_ptr, row, stride_gu, k0, offs, K, HAS_DIV)
        amax = tl.maximum(amax, tl.where(m, tl.abs(v), 0.0))
    scale = tl.math.div_rn(tl.max(amax, axis=0), 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    for k0 in tl.range(0, K, BLOCK, loop_unroll_factor=UNROLL):
        v, m = _swiglu_block(gu_ptr, div_ptr, row, stride_gu, k0, offs, K, HAS_DIV)
        r = tl.math.div_rn(v, tl.zeros((BLOCK,), dtype=tl.float32) + safe)
        tl.store(q_ptr + row * K + k0 + offs, _round_int8(r, ON_GPU), mask=m)
    tl.store(s_ptr + row, scale)


def _swiglu_chunk_kernel(
    gu_ptr, div_ptr, v_ptr, amax_ptr, K, stride_gu, CHUNKS,
    HAS_DIV: tl.constexpr, CHUNK: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): v = silu(g) * u (/ div) of CHUNK values of the row, stored, and
    their absmax (the split form's first launch)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < K
    g, u = _gate_up(gu_ptr + row * stride_gu, offs, m, "")
    v = _swiglu_value(g.to(tl.float32), u.to(tl.float32), div_ptr, 0, offs, m, HAS_DIV)
    tl.store(v_ptr + row * K + offs, v, mask=m)
    tl.store(amax_ptr + row * CHUNKS + c, tl.max(tl.where(m, tl.abs(v), 0.0), axis=0))


def _quant_chunk_kernel(
    v_ptr, amax_ptr, q_ptr, s_ptr, K, CHUNKS,
    CHUNK: tl.constexpr, CP: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the row's scale from its chunks' absmax (exact in any order), then
    the chunk's codes - the resident kernel's `div_rn` and rounding (the split form's second)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cs = tl.arange(0, CP)
    amax = tl.max(tl.load(amax_ptr + row * CHUNKS + cs, mask=cs < CHUNKS, other=0.0), axis=0)
    scale = tl.math.div_rn(amax, 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < K
    v = tl.load(v_ptr + row * K + offs, mask=m, other=0.0)
    r = tl.math.div_rn(v, tl.zeros((CHUNK,), dtype=tl.float32) + safe)
    tl.store(q_ptr + row * K + offs, _round_int8(r, ON_GPU), mask=m)
    if c == 0:
        tl.store(s_ptr + row, scale)


def _swiglu_chunk_absmax_kernel(
    gu_ptr, div_ptr, amax_ptr, K, stride_gu, CHUNKS,
    HAS_DIV: tl.constexpr, CHUNK: tl.constexpr, KEEP: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program p = row * CHUNKS + chunk: v of CHUNK values of the row and their absmax, stored
    (the recompute split's first launch; v itself is not kept). KEEP: gate and up loaded
    evict-last, so the second launch finds them in L2."""
    pid = tl.program_id(0)
    row = (pid // CHUNKS).to(tl.int64)
    c = pid % CHUNKS
    v, m = _swiglu_chunk_values(gu_ptr, div_ptr, row, c, K, stride_gu, HAS_DIV, CHUNK,
                                "evict_last" if KEEP else "")  # fmt: skip
    tl.store(amax_ptr + row * CHUNKS + c, tl.max(tl.where(m, tl.abs(v), 0.0), axis=0))


def _swiglu_chunk_codes_kernel(
    gu_ptr, div_ptr, amax_ptr, q_ptr, s_ptr, K, stride_gu, CHUNKS,
    HAS_DIV: tl.constexpr, CHUNK: tl.constexpr, CP: tl.constexpr, KEEP: tl.constexpr,
    REVERSE: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk), the first launch's programs in reverse order if REVERSE (the last
    loaded, most likely still in L2, first): the row's scale from its chunks' absmax (exact in
    any order), v computed again from gate and up (evict-first if KEEP: read for the last time)
    by the same helper, and the chunk's codes - the resident kernel's `div_rn` and rounding."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    row = (pid // CHUNKS).to(tl.int64)
    c = pid % CHUNKS
    cs = tl.arange(0, CP)
    amax = tl.max(tl.load(amax_ptr + row * CHUNKS + cs, mask=cs < CHUNKS, other=0.0), axis=0)
    scale = tl.math.div_rn(amax, 127.0)
    safe = tl.where(scale > 0, scale, 1.0)
    v, m = _swiglu_chunk_values(gu_ptr, div_ptr, row, c, K, stride_gu, HAS_DIV, CHUNK,
                                "evict_first" if KEEP else "")  # fmt: skip
    r = tl.math.div_rn(v, tl.zeros((CHUNK,), dtype=tl.float32) + safe)
    tl.store(q_ptr + row * K + c * CHUNK + tl.arange(0, CHUNK), _round_int8(r, ON_GPU), mask=m)
    if c == 0:
        tl.store(s_ptr + row, scale)


def _swiglu_chunk_values(gu_ptr, div_ptr, row, c, K, stride_gu, HAS_DIV: tl.constexpr,
                         CHUNK: tl.constexpr, POLICY: tl.constexpr):  # fmt: skip
    """v of chunk c of the row (both recompute launches: one helper, so the same instructions)
    and its mask; gate and up loaded with the L2 eviction POLICY ("" for the default)."""
    offs = c * CHUNK + tl.arange(0, CHUNK)
    m = offs < K
    g, u = _gate_up(gu_ptr + row * stride_gu, offs, m, POLICY)
    return _swiglu_value(g.to(tl.float32), u.to(tl.float32), div_ptr, 0, offs, m, HAS_DIV), m


def _gate_up(gu_row, k, m, POLICY: tl.constexpr):
    """Gate and up of the value indices k (any shape) of a row of the interleaved gate_up (gate
    j at column 2j, up j at 2j + 1), 0 where m is false, loaded with the L2 eviction POLICY
    ("" for the default): one load of the [*k.shape, 2] block, each gate beside its up, split
    in two. Every SwiGLU form reads through it. (sm_90, triton 3.9: the pairs compile to 8-byte
    loads, a pair a thread, where separate gate and up rows took 16-byte loads.)"""
    last: tl.constexpr = len(k.shape)
    pairs = tl.load(
        gu_row + 2 * tl.expand_dims(k, last) + tl.arange(0, 2),
        mask=tl.expand_dims(m, last), other=0.0, eviction_policy=POLICY,
    )  # fmt: skip
    return tl.split(pairs)


def _silu_times(g, u):
    """SiLU(gate) * up (fp32): the one expression every SwiGLU path computes v from."""
    return (g / (1.0 + tl.exp(-g))) * u


def _after(amax):
    """All true, but only once amax is computed: amax is a max of |v| and +0 (never negative,
    never a NaN with its sign set), so its sign bit, read by a PTX shift neither LLVM nor ptxas
    looks through, is 0. A load masked by it cannot be issued before amax is ready; the ordered
    resident kernel uses that to keep its loads where it wrote them (GPU only: the interpreter
    has no inline PTX and no reordering)."""
    sign = tl.inline_asm_elementwise(
        "shr.u32 $0, $1, 31;", "=r,r", [amax.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True, pack=1
    )
    return sign == 0


def _swiglu_value(g, u, div_ptr, k0, offs, m, HAS_DIV: tl.constexpr):
    """SiLU(gate) * up of the block at k0 from its gate and up (fp32), over the SmoothQuant
    divisor if HAS_DIV: the values both kernels quantize."""
    v = _silu_times(g, u)
    if HAS_DIV:
        v = tl.math.div_rn(v, tl.load(div_ptr + k0 + offs, mask=m, other=1.0).to(tl.float32))
    return v


def _swiglu_block(gu_ptr, div_ptr, row, stride_gu, k0, offs, K, HAS_DIV: tl.constexpr):
    """The long-row kernel's block at k0 of a row: gate and up loaded, their `_swiglu_value`,
    and the block's mask."""
    m = k0 + offs < K
    g, u = _gate_up(gu_ptr + row * stride_gu, k0 + offs, m, "")
    return _swiglu_value(g.to(tl.float32), u.to(tl.float32), div_ptr, k0, offs, m, HAS_DIV), m


_swiglu_block = helper(_swiglu_block)  # type: ignore[assignment]
_gate_up = helper(_gate_up)  # type: ignore[assignment]
_swiglu_value = helper(_swiglu_value)  # type: ignore[assignment]
_silu_times = helper(_silu_times)  # type: ignore[assignment]
_swiglu_chunk_values = helper(_swiglu_chunk_values)  # type: ignore[assignment]
_swiglu_resident_ordered = helper(_swiglu_resident_ordered)  # type: ignore[assignment]
_after = helper(_after)  # type: ignore[assignment]
_gated = kernel(_gated_norm_quant_kernel)
_gate_tile = helper(_gate_tile)  # type: ignore[assignment]
_gated_blocks = kernel(_gated_norm_blocks_kernel)
_swiglu_resident = kernel(_swiglu_resident_kernel)
_swiglu_long_row = kernel(_swiglu_long_row_kernel)
_swiglu_chunk = kernel(_swiglu_chunk_kernel)
_quant_chunk = kernel(_quant_chunk_kernel)
_swiglu_chunk_absmax = kernel(_swiglu_chunk_absmax_kernel)
_swiglu_chunk_codes = kernel(_swiglu_chunk_codes_kernel)


def gated_norm_quantize(
    o: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    divisor: torch.Tensor | None,
    eps: float,
    *,
    backend: Backend = "triton",
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows of rms_norm(o) * weight * silu(z) (/ divisor): (q [B, HV*dv], scale fp32 [B]).

    o fp32 [B, HV, dv]; z [B, HV * dv]; weight [dv]; divisor [HV * dv] or None.
    """
    b, hv, dv = o.shape
    if z.shape != (b, hv * dv) or weight.shape != (dv,):
        raise ValueError(
            f"need z [{b}, {hv * dv}] and weight [{dv}], got {tuple(z.shape)}, {tuple(weight.shape)}"
        )
    if not use_triton(backend, o):
        return gated_norm_quantize_reference(o, z, weight, divisor, eps)
    if dv & (dv - 1):
        raise ValueError(f"the kernel needs a power-of-two value head dim, got {dv}")
    o = o.contiguous()
    z = z if z.stride(1) == 1 else z.contiguous()
    q = torch.empty(b, hv * dv, dtype=torch.int8, device=o.device)
    scale = torch.empty(b, dtype=torch.float32, device=o.device)
    if GATED_FORM not in GATED_FORMS:
        raise ValueError(f"GATED_FORM must be one of {GATED_FORMS}, got {GATED_FORM!r}")
    args = (o, z, weight.contiguous(), divisor.contiguous() if divisor is not None else scale, q, scale)
    if GATED_FORM == "blocks":
        hb = min(next_pow2(GATED_BLOCK_HEADS), next_pow2(hv))
        _gated_blocks[(b,)](
            *args, z.stride(0), float(eps),
            HV=hv, HB=hb, NB=cdiv(hv, hb), DV=dv, HAS_DIV=divisor is not None, Z_AHEAD=GATED_Z_AHEAD,
            num_warps=GATED_BLOCK_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
        return q, scale
    _gated[(b,)](
        *args, z.stride(0), float(eps),
        HV=hv, HP=next_pow2(hv), DV=dv, HAS_DIV=divisor is not None,
        num_warps=GATED_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return q, scale


def swiglu_quantize(
    gate_up: torch.Tensor, divisor: torch.Tensor | None, *, backend: Backend = "triton"
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows of silu(gate) * up (/ divisor): (q int8 [B, K], scale fp32 [B]).

    gate_up [B, 2K] is the stacked gate+up GEMM's output as stored: gate j at column 2j and up j
    at 2j + 1 (the weight's gate and up rows interleaved, so Hopper's one CUTLASS GEMM holds a
    gate and its up in one thread's registers: `cutlass_gemm`'s `swiglu_pairs`); any row stride.
    divisor [K] or None.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(
            f"gate_up must be [B, 2K] (gate j at column 2j, up j at 2j + 1), got {tuple(gate_up.shape)}"
        )
    b, k = gate_up.shape[0], gate_up.shape[1] // 2
    if divisor is not None and divisor.shape != (k,):
        raise ValueError(f"the divisor must be [{k}] (gate_up [{b}, {2 * k}]), got {tuple(divisor.shape)}")
    if not use_triton(backend, gate_up):
        gate, up = split_gate_up(gate_up)
        return quantize_rows_reference(F.silu(gate.float()) * up.float(), divisor)
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    q = torch.empty(b, k, dtype=torch.int8, device=gate_up.device)
    scale = torch.empty(b, dtype=torch.float32, device=gate_up.device)
    div = divisor.contiguous() if divisor is not None else scale  # unread placeholder
    if RECOMPUTE_ROWS is not None and RECOMPUTE_ROWS[0] <= b <= RECOMPUTE_ROWS[1] and b and k:
        chunks = cdiv(k, RECOMPUTE_CHUNK)
        amax = torch.empty(b, chunks, dtype=torch.float32, device=gate_up.device)
        _swiglu_chunk_absmax[(b * chunks,)](
            gate_up, div, amax, k, gate_up.stride(0), chunks,
            HAS_DIV=divisor is not None, CHUNK=RECOMPUTE_CHUNK, KEEP=RECOMPUTE_L2_HINTS,
            num_warps=RECOMPUTE_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
        _swiglu_chunk_codes[(b * chunks,)](
            gate_up, div, amax, q, scale, k, gate_up.stride(0), chunks,
            HAS_DIV=divisor is not None, CHUNK=RECOMPUTE_CHUNK, CP=next_pow2(chunks),
            KEEP=RECOMPUTE_L2_HINTS, REVERSE=RECOMPUTE_REVERSE, num_warps=RECOMPUTE_WARPS,
            enable_fp_fusion=False,
        )  # fmt: skip
        return q, scale
    if b <= SPLIT_MAX_ROWS and b and k:
        chunks = cdiv(k, SPLIT_CHUNK)
        v = torch.empty(b, k, dtype=torch.float32, device=gate_up.device)
        amax = torch.empty(b, chunks, dtype=torch.float32, device=gate_up.device)
        _swiglu_chunk[(b, chunks)](
            gate_up, div, v, amax, k, gate_up.stride(0), chunks,
            HAS_DIV=divisor is not None, CHUNK=SPLIT_CHUNK, num_warps=SPLIT_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
        _quant_chunk[(b, chunks)](
            v, amax, q, scale, k, chunks,
            CHUNK=SPLIT_CHUNK, CP=next_pow2(chunks), num_warps=SPLIT_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
        return q, scale
    block = min(next_pow2(k), RESIDENT_BLOCK)
    warps = RESIDENT_WARPS if block == RESIDENT_BLOCK else 4
    if cdiv(k, block) * block <= RESIDENT_VALUES * 32 * warps:
        extra = {} if RESIDENT_MAXNREG is None else {"maxnreg": RESIDENT_MAXNREG}
        _swiglu_resident[(b,)](
            gate_up, div, q, scale, k, gate_up.stride(0),
            HAS_DIV=divisor is not None, BLOCK=block, NB=cdiv(k, block), AHEAD=RESIDENT_AHEAD,
            ORDERED=RESIDENT_ORDERED and block >= 4, num_warps=warps, enable_fp_fusion=False, **extra,
        )  # fmt: skip
        return q, scale
    block = min(next_pow2(k), LONG_ROW_BLOCK)
    _swiglu_long_row[(b,)](
        gate_up, div, q, scale, k, gate_up.stride(0),
        HAS_DIV=divisor is not None, BLOCK=block, UNROLL=LONG_ROW_UNROLL,
        num_warps=LONG_ROW_WARPS if block >= 2048 else 4, enable_fp_fusion=False,
    )  # fmt: skip
    return q, scale


def gated_norm_quantize_reference(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, divisor: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hv, dv = o.shape
    of = o.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)) * weight.float()
    y = normed * F.silu(z.float().view(b, hv, dv))
    return quantize_rows_reference(y.reshape(b, hv * dv), divisor)
