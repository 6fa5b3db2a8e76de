"""Gated DeltaNet over a packed forest: the conv of all T tokens at once, the recurrence level by level.

Two kernels per GDN layer, reading the tables of `engine.kernels.forest_tables`:

- `forest_conv`: programs tile (token block, channel block) of all T packed tokens and compute
  SiLU(causal depthwise conv) of each live row. A token at local index l of its segment sees
  the inputs at local positions l-W+1 .. l: positions >= 0 are the segment's own rows
  (tok_lo + p), positions < 0 come from the segment's `conv_src` (zeros, a packed row of an
  ancestor in this pass, or a stored tail in `base`), so no level ordering is needed. A token
  block lying inside one segment past its first W-1 rows (most of a long prefill) reads its
  windows straight from the packed rows, with no table lookups. The window is summed oldest
  to newest, as the decode step's `engine.kernels.decode_gdn.conv_step` does. Extra programs
  (segment slot block, channel block) write every live segment's final tail (its last W-1
  inputs, oldest first) to its conv_out block; a length-0 segment's final tail is its sources.
- `forest_gdn`: program (segment slot, value head, value block) of the segments of one level
  walks the segment's tokens with its state block S[:, block] (fp32, [dk, BV]) in registers,
  applying per token exactly the fused math of `engine.kernels.decode_gdn` (l2-normalised q
  and k, beta = sigmoid(b), g = ssm_a * softplus(a + dt), then
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q), from the state block at
  state_in (or zeros) to its own state_out block. The caller launches levels 0, 1, 2, ... in
  order, so a child's state_in is its parent's state_out written by the previous launch.
  With chunk C it walks the segment C tokens at a time in matrix products instead, reading the
  state-free part of each chunk (w, u, the cumulative decay) that `forest_gdn_prep` computed
  for all chunks of all levels in one parallel launch before the levels: only the products
  with the state stay serial.

A program reads only its own segment's rows, sources and state with a config fixed by the
head sizes (and `enable_fp_fusion=False`, as the decode step kernels), so a segment's bits
never depend on what else is packed in the pass, and a forest segment continues exactly as
decode steps would. Padding rows get zero conv outputs; padding slots read and write nothing.

Blocks are written in place while others are read, in no particular order: within one pass
no conv_out block may overlap a CONV_TAIL source, and within one level no state_out block
may overlap a state_in block of another segment (a segment's own state_in = state_out is fine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels._triton import Backend, cdiv, helper, kernel, use_triton
from engine.kernels.decode_gdn import _gdn_token
from engine.kernels.forest_tables import (
    BLOCK_M,
    CONV_ROW,
    CONV_TAIL,
    CONV_ZERO,
    QBLOCK_FIELDS,
    ROW_FIELDS,
    ROW_LIVE,
    ROW_LOCAL,
    ROW_SEG,
    SEG_CONV_OUT,
    SEG_FIELDS,
    SEG_HAS_STATE_IN,
    SEG_LENGTH,
    SEG_LEVEL,
    SEG_LIVE,
    SEG_STATE_IN,
    SEG_STATE_OUT,
    SEG_TOK_LO,
)
from engine.run.reference import L2NORM_EPS, causal_conv, gated_delta_rule, l2_normalize

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

BLOCK_V = 32
NUM_WARPS = 4
CHUNK = 32  # tokens per step of the chunked recurrence (64 needs more shared memory than sm_90 has)
CHUNK_WARPS = 8

# The kernel bodies read the table fields at these fixed positions.
assert (ROW_SEG, ROW_LOCAL, ROW_LIVE, ROW_FIELDS) == (0, 1, 2, 4)
assert (SEG_TOK_LO, SEG_LENGTH, SEG_LEVEL, SEG_STATE_IN, SEG_HAS_STATE_IN) == (0, 1, 2, 3, 4)
assert (SEG_STATE_OUT, SEG_CONV_OUT, SEG_LIVE, SEG_FIELDS) == (5, 6, 7, 8)
assert (CONV_ZERO, CONV_ROW, CONV_TAIL) == (0, 1, 2)


# The conv's tiles: 16 x 128 on 4 warps, the fastest of the benched blockings at every size on
# the H200 (2026-12-02, bench_rows.py, tree 9866e5c: 188.8 us at 8,192 rows against 252.6 for
# 32 x 128 on 8 warps and 749.4 for the kernel before, which read every row through the source
# tables; 2.97 / 6.13 us at 1 / 64 rows against 4.39 / 9.73). No tiling changes a bit (tested).
CONV_BLOCK_T = 16  # tokens per program (also the segment slots per final-tail program)
CONV_BLOCK_C = 128
CONV_WARPS = 4
CONV_GENERAL_ROWS = 4  # rows (final-tail slots) per step of the general and final-tail paths


def _forest_conv_kernel(
    x_ptr, w_ptr, base_ptr, rows_ptr, segs_ptr, src_ptr, y_ptr,
    layer_off, T, C, S, stride_x, stride_y, num_t_blocks,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BG: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (token block, channel block): SiLU(conv) of BT packed rows; programs past the
    token blocks write the final tails of BT segment slots.

    Rows of a live segment are packed contiguously (row tok_lo + l holds local position l), so
    when a block's first and last rows are live rows of one segment and the first sits at
    local index >= W - 1, every window element of every row of the block is the segment's own
    row r - (W - 1) + j: the block reads those rows directly (the direct path), without the
    per-row segment and source-table loads and their selects, and its loads wait for no chain
    of table loads. Every other block (segment starts and boundaries, padding) takes the
    general path - rows at local index >= W - 1 as above, the first W - 1 rows of a segment
    through the source tables - and the final-tail programs theirs, BG rows or slots at a
    time: those paths hold many pointers per element, and in [BT, BC] tiles they would set
    the registers (and so the occupancy) of the whole kernel. Each element's window is summed
    oldest first with the same ops (fp fusion off) on every path and at every tile shape, so
    a row's bits depend neither on the path nor on the tiling."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_c = pid_c * BC + tl.arange(0, BC)
    cmask = offs_c < C
    tail_c = offs_c.to(tl.int64) * (W - 1)  # channel c of a tail block starts at c * (W - 1)
    if pid_t < num_t_blocks:
        t0 = pid_t * BT
        # row record: (segment slot, local index, live, token); the block's first and last rows
        first = t0.to(tl.int64) * 4
        last = tl.minimum(t0 + BT, T).to(tl.int64) * 4 - 4
        direct = (
            (tl.load(rows_ptr + first + 2) != 0)
            & (tl.load(rows_ptr + last + 2) != 0)
            & (tl.load(rows_ptr + first) == tl.load(rows_ptr + last))
            & (tl.load(rows_ptr + first + 1) >= W - 1)
        )
        offs_t = t0 + tl.arange(0, BT)
        in_range = offs_t < T
        if direct:
            m = in_range[:, None] & cmask[None, :]
            acc = _conv_own_rows(x_ptr, w_ptr, offs_t, offs_c, cmask, m, stride_x, W, BT, BC)
            _conv_out(acc, y_ptr, offs_t, stride_y, offs_c, m)
        else:
            # rows at local index >= W - 1 of their segment (and padding rows, which stay zero) in
            # one tile as above; the rows whose window reaches before their segment (the first
            # W - 1 of each) through the tables, BG rows at a time, only the steps that hold one
            rec = offs_t.to(tl.int64) * 4
            live = in_range & (tl.load(rows_ptr + rec + 2, mask=in_range, other=0) != 0)
            local = tl.load(rows_ptr + rec + 1, mask=live, other=0)
            near = live & (local < W - 1)
            own = (live & (local >= W - 1))[:, None] & cmask[None, :]
            acc = _conv_own_rows(x_ptr, w_ptr, offs_t, offs_c, cmask, own, stride_x, W, BT, BC)
            _conv_out(acc, y_ptr, offs_t, stride_y, offs_c, (in_range & ~near)[:, None] & cmask[None, :])
            step = tl.where(near, (offs_t - t0) // BG, BT)  # the step of each such row
            for g0 in tl.range(0, tl.minimum(BT, T - t0), BG):
                if tl.min(tl.where(step == g0 // BG, 0, 1), axis=0) == 0:
                    offs_g = t0 + g0 + tl.arange(0, BG)
                    rec_g = offs_g.to(tl.int64) * 4
                    live_g = (offs_g < T) & (tl.load(rows_ptr + rec_g + 2, mask=offs_g < T, other=0) != 0)
                    seg = tl.load(rows_ptr + rec_g, mask=live_g, other=0)
                    local_g = tl.load(rows_ptr + rec_g + 1, mask=live_g, other=0)
                    near_g = live_g & (local_g < W - 1)
                    acc_g = tl.zeros((BG, BC), dtype=tl.float32)
                    for j in tl.static_range(W):
                        lp = local_g - (W - 1) + j  # local position of window element j (oldest first)
                        xv = _window_input(
                            x_ptr, base_ptr, src_ptr, offs_g.to(tl.int64) - (W - 1) + j, seg, lp, live_g,
                            offs_c, cmask, tail_c, stride_x, layer_off, W,
                        )  # fmt: skip
                        wj = tl.load(w_ptr + offs_c * W + j, mask=cmask, other=0.0).to(tl.float32)
                        acc_g += xv * wj[None, :]
                    _conv_out(acc_g, y_ptr, offs_g, stride_y, offs_c, near_g[:, None] & cmask[None, :])
    else:
        # final tails: the last W - 1 inputs of every live segment, oldest first
        s0 = (pid_t - num_t_blocks) * BT
        for g0 in tl.range(0, tl.minimum(BT, S - s0), BG):
            offs_s = s0 + g0 + tl.arange(0, BG)
            smask = offs_s < S
            rec = offs_s.to(tl.int64) * 8
            live = smask & (tl.load(segs_ptr + rec + 7, mask=smask, other=0) != 0)
            tok_lo = tl.load(segs_ptr + rec, mask=live, other=0)
            length = tl.load(segs_ptr + rec + 1, mask=live, other=0)
            conv_out = tl.load(segs_ptr + rec + 6, mask=live, other=0)
            m = live[:, None] & cmask[None, :]
            dst = base_ptr + (conv_out + layer_off)[:, None] + tail_c[None, :]
            slots = offs_s.to(tl.int64)
            for k in tl.static_range(W - 1):
                lp = length - (W - 1) + k
                xv = _window_input(
                    x_ptr, base_ptr, src_ptr, tok_lo + lp, slots, lp, live, offs_c, cmask, tail_c, stride_x,
                    layer_off, W,
                )  # fmt: skip
                tl.store(dst + k, xv, mask=m)


def _window_input(
    x_ptr, base_ptr, src_ptr, own_row, slot, lp, live, offs_c, cmask, tail_c, stride_x, layer_off,
    W: tl.constexpr,
):  # fmt: skip
    """Pre-conv inputs [rows, channels] at local positions lp of segments `slot` (per row):
    their own packed rows (own_row) where lp >= 0, else conv_src[slot, W - 1 + lp] - a row of
    this pass, a stored tail's column in base, or zero. Dead rows (live false) read zeros. An
    own row and a source row are both rows of x, so one load reads either."""
    own = live & (lp >= 0)
    pre = live & (lp < 0)
    src = (slot * (W - 1) + lp + (W - 1)) * 2
    kind = tl.load(src_ptr + src, mask=pre, other=0)
    val = tl.load(src_ptr + src + 1, mask=pre, other=0)
    from_row = pre & (kind == 1)
    from_tail = pre & (kind == 2)
    row = tl.where(own, own_row, val)
    xv = tl.load(
        x_ptr + row[:, None] * stride_x + offs_c[None, :],
        mask=(own | from_row)[:, None] & cmask[None, :],
        other=0.0,
    ).to(tl.float32)
    tv = tl.load(
        base_ptr + (val + layer_off)[:, None] + tail_c[None, :],
        mask=from_tail[:, None] & cmask[None, :],
        other=0.0,
    )
    return tl.where(from_tail[:, None], tv, xv)


def _conv_own_rows(
    x_ptr, w_ptr, offs_t, offs_c, cmask, m, stride_x, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr
):  # fmt: skip
    """Window sums of rows whose window lies in their own segment: element j of row r is row
    r - (W - 1) + j, summed oldest first (the order of every path); zeros where m is false."""
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        r = (offs_t - (W - 1) + j).to(tl.int64)
        xv = tl.load(x_ptr + r[:, None] * stride_x + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + offs_c * W + j, mask=cmask, other=0.0).to(tl.float32)
        acc += xv * wj[None, :]
    return acc


def _conv_out(acc, y_ptr, offs_t, stride_y, offs_c, m):
    """SiLU of the window sums, stored to their rows (padding rows: acc = 0, SiLU(0) = 0)."""
    acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * stride_y + offs_c[None, :], acc, mask=m)


_conv_out = helper(_conv_out)  # type: ignore[assignment]
_conv_own_rows = helper(_conv_own_rows)  # type: ignore[assignment]
_window_input = helper(_window_input)  # type: ignore[assignment]
_conv = kernel(_forest_conv_kernel)


def _forest_gdn_kernel(
    conv_ptr, b_ptr, a_ptr, ssm_a_ptr, dt_ptr, base_ptr, segs_ptr, o_ptr, w_ptr, u_ptr, g_ptr,
    level, layer_off, stride_conv, stride_b, stride_a, q_scale, l2_eps,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BV: tl.constexpr, BC: tl.constexpr, DOTS: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, DK)
    rec = segs_ptr + slot.to(tl.int64) * 8
    live = tl.load(rec + 7)
    seg_level = tl.load(rec + 2)
    if (live != 0) & (seg_level == level):
        tok_lo = tl.load(rec)
        length = tl.load(rec + 1)
        state_in = tl.load(rec + 3)
        has_in = tl.load(rec + 4)
        state_out = tl.load(rec + 5)
        hk = h // (HV // HQK)  # grouped value heads: value head h reads key head h // (HV / HQK)
        blk = layer_off + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
        imask = (offs_k[:, None] * 0 + offs_v[None, :] * 0 + has_in) != 0  # block-shaped (interpreter)
        s = tl.load(base_ptr + state_in + blk, mask=imask, other=0.0)
        if BC == 0:
            ssm_a = tl.load(ssm_a_ptr + h).to(tl.float32)
            dt = tl.load(dt_ptr + h).to(tl.float32)
            for t in range(tok_lo, tok_lo + length):
                # one token: exactly the decode step's arithmetic (decode_gdn._gdn_token)
                src = conv_ptr + t * stride_conv
                q = tl.load(src + hk * DK + offs_k)
                k = tl.load(src + HQK * DK + hk * DK + offs_k)
                v = tl.load(src + 2 * HQK * DK + h * DV + offs_v)
                b = tl.load(b_ptr + t * stride_b + h).to(tl.float32)
                x = tl.load(a_ptr + t * stride_a + h).to(tl.float32) + dt
                s, o = _gdn_token(s, q, k, v, b, x, ssm_a, q_scale, l2_eps, ON_GPU)
                tl.store(o_ptr + (t * HV + h) * DV + offs_v, o)
        else:  # BC tokens at a time, from the chunk products of `_forest_gdn_prep_kernel`
            offs_c = tl.arange(0, BC)
            causal = offs_c[:, None] >= offs_c[None, :]
            for c0 in range(0, length, BC):
                valid = (c0 + offs_c) < length
                rows = tok_lo + c0 + offs_c
                src = conv_ptr + rows[:, None] * stride_conv
                q = tl.load(src + hk * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
                k = tl.load(src + HQK * DK + hk * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
                q = q * (tl.math.rsqrt(tl.sum(q * q, axis=1) + l2_eps) * q_scale)[:, None]
                k = k * tl.math.rsqrt(tl.sum(k * k, axis=1) + l2_eps)[:, None]
                at = rows * HV + h
                gam = tl.load(g_ptr + at, mask=valid, other=0.0)
                w = tl.load(w_ptr + at[:, None] * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
                u = tl.load(u_ptr + at[:, None] * DV + offs_v[None, :], mask=valid[:, None], other=0.0)
                u = u - tl.dot(w, s, input_precision=DOTS)  # the chunk's delta-rule updates
                # exp(gam_i - gam_j) for j <= i (at most 1: g <= 0); 0 above the diagonal and on
                # rows past the segment end (their gam reads 0: no overflow to multiply by 0)
                seen = causal & valid[:, None]
                decay = tl.exp(tl.where(seen, gam[:, None] - gam[None, :], float("-inf")))
                qk = tl.dot(q, tl.trans(k), input_precision=DOTS)
                o = tl.dot(q * tl.exp(gam)[:, None], s, input_precision=DOTS)
                o = o + tl.dot(tl.where(seen, qk * decay, 0.0), u, input_precision=DOTS)
                tl.store(o_ptr + (rows[:, None] * HV + h) * DV + offs_v[None, :], o, mask=valid[:, None])
                last = tl.minimum(length - c0, BC) - 1
                g_all = tl.sum(tl.where(offs_c == last, gam, 0.0), axis=0)  # decay through the chunk
                kd = k * tl.exp(g_all - gam)[:, None]
                s = s * tl.exp(g_all) + tl.dot(tl.trans(kd), u, input_precision=DOTS)
        tl.store(base_ptr + state_out + blk, s)


def _forest_gdn_prep_kernel(
    conv_ptr, b_ptr, a_ptr, ssm_a_ptr, dt_ptr, segs_ptr, qblocks_ptr, w_ptr, u_ptr, g_ptr,
    stride_conv, stride_b, stride_a, l2_eps,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    BC: tl.constexpr, LOG2_BC: tl.constexpr, DOTS: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (query block, value head): the state-free products of the chunk that starts at
    the block, if one does (chunks are aligned to the segment start like the query blocks of
    BLOCK_M rows, and BC is a multiple of BLOCK_M): one program per BLOCK_M packed rows at
    most, not one per (slot, chunk) pair of the bucket."""
    qb = tl.program_id(0).to(tl.int64) * 3  # query block record: slot, first local index, live
    h = tl.program_id(1)
    slot = tl.load(qblocks_ptr + qb)
    c0 = tl.load(qblocks_ptr + qb + 1)
    rec = segs_ptr + slot * 8
    length = tl.load(rec + 1)
    if (tl.load(qblocks_ptr + qb + 2) != 0) & (c0 % BC == 0) & (c0 < length):
        tok_lo = tl.load(rec)
        hk = h // (HV // HQK)
        offs_c = tl.arange(0, BC)
        offs_k = tl.arange(0, DK)
        valid = (c0 + offs_c) < length
        rows = tok_lo + c0 + offs_c
        src = conv_ptr + rows[:, None] * stride_conv
        k = tl.load(src + HQK * DK + hk * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=1) + l2_eps)[:, None]
        b = tl.load(b_ptr + rows * stride_b + h, mask=valid, other=0.0).to(tl.float32)
        beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)
        x = tl.load(a_ptr + rows * stride_a + h, mask=valid, other=0.0).to(tl.float32)
        x = x + tl.load(dt_ptr + h).to(tl.float32)
        soft = libdevice.log1p(tl.exp(x)) if ON_GPU else tl.log(1.0 + tl.exp(x))
        soft = tl.where(x > 20.0, x, soft)
        g = tl.where(valid, tl.load(ssm_a_ptr + h).to(tl.float32) * soft, 0.0)  # log decay per token
        gam = tl.cumsum(g, axis=0)  # decay from the chunk start through token i
        below = offs_c[:, None] > offs_c[None, :]  # strictly earlier token j < i
        decay = tl.exp(tl.where(below, gam[:, None] - gam[None, :], float("-inf")))
        kk = tl.dot(k, tl.trans(k), input_precision=DOTS)
        a_mat = tl.where(below, (beta[:, None] * kk) * decay, 0.0)
        # T = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(BC/2)): A is strictly lower
        # triangular, so A^BC = 0 and the series sum_n (-A)^n stops - matrix products only
        eye = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)
        t_mat = eye - a_mat
        power = a_mat
        for _ in tl.static_range(LOG2_BC - 1):
            power = tl.dot(power, power, input_precision=DOTS)
            t_mat = t_mat + tl.dot(t_mat, power, input_precision=DOTS)
        at = rows * HV + h
        tl.store(g_ptr + at, gam, mask=valid)
        w = tl.dot(t_mat, k * (beta * tl.exp(gam))[:, None], input_precision=DOTS)
        tl.store(w_ptr + at[:, None] * DK + offs_k[None, :], w, mask=valid[:, None])
        for vb in tl.static_range(DV // BV):
            offs_v = vb * BV + tl.arange(0, BV)
            v = tl.load(src + 2 * HQK * DK + h * DV + offs_v[None, :], mask=valid[:, None], other=0.0)
            u = tl.dot(t_mat, v * beta[:, None], input_precision=DOTS)
            tl.store(u_ptr + at[:, None] * DV + offs_v[None, :], u, mask=valid[:, None])


# ------------------------------------------------------------------------ chunk 64 on tensor cores
def _mm(a, b, BF16: tl.constexpr, ON_GPU: tl.constexpr):
    """a @ b with fp32 accumulation: bf16 operands (BF16) or tf32 ones. The interpreter's dot
    cannot take bf16, so there the operands are rounded to bf16 and multiplied in fp32: the
    same operand rounding, only the accumulation order differs."""
    if BF16:
        if ON_GPU:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            a16 = a.to(tl.bfloat16).to(tl.float32)
            return tl.dot(a16, b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32")


def _tc_rows(
    conv_ptr, b_ptr, a_ptr, rows, valid, hk, h, stride_conv, stride_b, stride_a, ssm_a, dt, l2_eps,
    HQK: tl.constexpr, DK: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """The rows' l2-normalised k [R, DK], beta and log decay g [R], and k's scale [R]; rows past
    the segment end (valid false) are zeros."""
    offs_k = tl.arange(0, DK)
    k = tl.load(conv_ptr + rows[:, None] * stride_conv + HQK * DK + hk * DK + offs_k[None, :],
                mask=valid[:, None], other=0.0)  # fmt: skip
    k_scale = tl.math.rsqrt(tl.sum(k * k, axis=1) + l2_eps)
    k = k * k_scale[:, None]
    b = tl.load(b_ptr + rows * stride_b + h, mask=valid, other=0.0).to(tl.float32)
    beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)
    x = tl.load(a_ptr + rows * stride_a + h, mask=valid, other=0.0).to(tl.float32) + dt
    soft = libdevice.log1p(tl.exp(x)) if ON_GPU else tl.log(1.0 + tl.exp(x))
    soft = tl.where(x > 20.0, x, soft)
    g = tl.where(valid, ssm_a * soft, 0.0)
    return k, beta, g, k_scale


def _tc_q(
    conv_ptr, rows, valid, hk, gm, at, qg_ptr, qs_ptr, store_q, stride_conv, q_scale, l2_eps,
    DK: tl.constexpr,
):  # fmt: skip
    """The rows' l2-normalised q times q_scale [R, DK] (loaded late: registers); stores q exp(gam)
    (store_q nonzero), else q's scale per row."""
    offs_k = tl.arange(0, DK)
    q = tl.load(
        conv_ptr + rows[:, None] * stride_conv + hk * DK + offs_k[None, :], mask=valid[:, None], other=0.0
    )
    scale = tl.math.rsqrt(tl.sum(q * q, axis=1) + l2_eps) * q_scale
    q = q * scale[:, None]
    qg = (q * tl.exp(gm)[:, None]).to(qg_ptr.dtype.element_ty)
    kept = (at * 0 + store_q) != 0  # row-shaped (interpreter)
    tl.store(qg_ptr + at[:, None] * DK + offs_k[None, :], qg, mask=(valid & kept)[:, None])
    tl.store(qs_ptr + at, scale, mask=valid & ~kept)
    return q


def _inv16(a):
    """(I + a)^-1 of a strictly lower triangular 16 x 16 block in fp32: (I - a)(I + a^2)(I + a^4)
    (I + a^8), exact since a^16 = 0 (fp32 FMA dots: this is the part that conditions the rest)."""
    offs = tl.arange(0, 16)
    t = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0) - a
    p = a
    for _ in tl.static_range(3):
        p = tl.dot(p, p, input_precision="ieee")
        t = t + tl.dot(t, p, input_precision="ieee")
    return t


def _kk(k_i, k_j, beta_i, gm_i, gm_j, DIAG: tl.constexpr, BF16: tl.constexpr, ON_GPU: tl.constexpr):
    """Block (i, j) of A: beta_r exp(gam_r - gam_c) k_r.k_c for c < r (on a diagonal block: below it)."""
    diff = gm_i[:, None] - gm_j[None, :]  # <= 0 below the diagonal; masked before exp above it
    if DIAG:
        offs = tl.arange(0, 16)
        diff = tl.where(offs[:, None] > offs[None, :], diff, float("-inf"))
    return _mm(k_i, tl.trans(k_j), BF16, ON_GPU) * beta_i[:, None] * tl.exp(diff)


def _qk(
    q_i, k_j, gm_i, gm_j, at, aqk_ptr, col: tl.constexpr, valid,
    DIAG: tl.constexpr, BF16: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Store block (i, j) of the chunk's causal decayed scores exp(gam_r - gam_c) q_r.k_c (c <= r)."""
    offs = tl.arange(0, 16)
    diff = gm_i[:, None] - gm_j[None, :]
    if DIAG:
        diff = tl.where(offs[:, None] >= offs[None, :], diff, float("-inf"))
    a = _mm(q_i, tl.trans(k_j), BF16, ON_GPU) * tl.exp(diff)
    dst = aqk_ptr + at[:, None] * 64 + col + offs[None, :]
    tl.store(dst, a.to(aqk_ptr.dtype.element_ty), mask=valid[:, None])


def _tc_chunk_number(qblocks_ptr, segs_ptr, hidx_ptr, qb, row):
    """Store at `row` (a chunk's first packed row) the chunk's number: how many query blocks
    before block qb in the table start a 64-token chunk of a live segment (a count over the
    table, no host work). The split walk stores the chunk's start state under that number."""
    n = qb * 0
    offs_q = tl.arange(0, 256)
    for i0 in range(0, qb, 256):
        i = (i0 + offs_q).to(tl.int64)
        m = i < qb
        q_slot = tl.load(qblocks_ptr + i * 3, mask=m, other=0)
        q_lo = tl.load(qblocks_ptr + i * 3 + 1, mask=m, other=1)
        q_live = m & (tl.load(qblocks_ptr + i * 3 + 2, mask=m, other=0) != 0)
        q_len = tl.load(segs_ptr + q_slot * 8 + 1, mask=q_live, other=0)
        n += tl.sum((q_live & (q_lo % 64 == 0) & (q_lo < q_len)).to(tl.int32), axis=0)
    tl.store(hidx_ptr + row, n)


def _forest_gdn_tc_prep_kernel(
    conv_ptr, b_ptr, a_ptr, ssm_a_ptr, dt_ptr, segs_ptr, qblocks_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, g_ptr, hidx_ptr, qs_ptr, ks_ptr, gt_ptr, store_q, store_k,
    stride_conv, stride_b, stride_a, q_scale, l2_eps,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BF16: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (query block, value head): everything of the 64-token chunk that starts at the
    block (if one does) that needs no state, in four 16-row blocks: the WY form's w and u by
    block forward substitution X_i = (I + A_ii)^-1 (B_i - sum_{j<i} A_ij X_j), the decayed
    causal scores, q exp(gam), k exp(gam_last - gam) and gam itself. Head 0 also writes the
    chunk's number (how many chunk-starting query blocks precede it in the table: a count over
    the table, no host work) at the chunk's first packed row; the split walk stores the chunk's
    start state under that number. store_q / store_k 0 (TC_DECAYED_FORMS): q exp(gam) / k
    exp(gam_last - gam) are not stored, only q's / k's l2-norm scales per row (and for k the
    chunk's gam_last at its first row), from which the outputs / the walk make them: a runtime
    switch of masked stores, so every form runs one build and computes the same bits."""
    qb = tl.program_id(0).to(tl.int64) * 3  # query block record: slot, first local index, live
    h = tl.program_id(1)
    slot = tl.load(qblocks_ptr + qb)
    c0 = tl.load(qblocks_ptr + qb + 1)
    rec = segs_ptr + slot * 8
    length = tl.load(rec + 1)
    if (tl.load(qblocks_ptr + qb + 2) != 0) & (c0 % 64 == 0) & (c0 < length):
        tok_lo = tl.load(rec)
        if h == 0:
            _tc_chunk_number(qblocks_ptr, segs_ptr, hidx_ptr, tl.program_id(0), tok_lo + c0)
        hk = h // (HV // HQK)
        ssm_a = tl.load(ssm_a_ptr + h).to(tl.float32)
        dt = tl.load(dt_ptr + h).to(tl.float32)
        offs = tl.arange(0, 16)
        offs_k = tl.arange(0, DK)
        offs_v = tl.arange(0, DV)
        r0 = tok_lo + c0 + offs
        v0, v1, v2, v3 = (
            c0 + offs < length,
            c0 + 16 + offs < length,
            c0 + 32 + offs < length,
            c0 + 48 + offs < length,
        )
        k0, be0, g0, ks0 = _tc_rows(
            conv_ptr, b_ptr, a_ptr, r0, v0, hk, h, stride_conv, stride_b, stride_a, ssm_a, dt, l2_eps,
            HQK, DK, ON_GPU,
        )  # fmt: skip
        k1, be1, g1, ks1 = _tc_rows(
            conv_ptr, b_ptr, a_ptr, r0 + 16, v1, hk, h, stride_conv, stride_b, stride_a, ssm_a, dt, l2_eps,
            HQK, DK, ON_GPU,
        )  # fmt: skip
        k2, be2, g2, ks2 = _tc_rows(
            conv_ptr, b_ptr, a_ptr, r0 + 32, v2, hk, h, stride_conv, stride_b, stride_a, ssm_a, dt, l2_eps,
            HQK, DK, ON_GPU,
        )  # fmt: skip
        k3, be3, g3, ks3 = _tc_rows(
            conv_ptr, b_ptr, a_ptr, r0 + 48, v3, hk, h, stride_conv, stride_b, stride_a, ssm_a, dt, l2_eps,
            HQK, DK, ON_GPU,
        )  # fmt: skip
        # cumulative log decay from the chunk start (rows past the end add 0)
        e0 = tl.sum(g0, axis=0)
        e1 = e0 + tl.sum(g1, axis=0)
        e2 = e1 + tl.sum(g2, axis=0)
        last = e2 + tl.sum(g3, axis=0)  # through the chunk's last row
        m0 = tl.cumsum(g0, axis=0)
        m1 = e0 + tl.cumsum(g1, axis=0)
        m2 = e1 + tl.cumsum(g2, axis=0)
        m3 = e2 + tl.cumsum(g3, axis=0)
        at0 = r0 * HV + h
        at1, at2, at3 = at0 + 16 * HV, at0 + 32 * HV, at0 + 48 * HV
        tl.store(g_ptr + at0, m0, mask=v0)
        tl.store(g_ptr + at1, m1, mask=v1)
        tl.store(g_ptr + at2, m2, mask=v2)
        tl.store(g_ptr + at3, m3, mask=v3)
        dk_ = offs_k[None, :]
        op = qg_ptr.dtype.element_ty
        # k exp(gam_last - gam) (store_k), or k's scales and gam_last for the walk to make it:
        # a runtime switch of masked stores, so every TC_DECAYED_FORMS form runs this one build
        kept, remade = (offs * 0 + store_k) != 0, (offs * 0 + store_k) == 0  # row-shaped (interpreter)
        tl.store(gt_ptr + at0, tl.where(offs == 0, last, 0.0), mask=(offs == 0) & v0 & remade)
        tl.store(ks_ptr + at0, ks0, mask=v0 & remade)
        tl.store(ks_ptr + at1, ks1, mask=v1 & remade)
        tl.store(ks_ptr + at2, ks2, mask=v2 & remade)
        tl.store(ks_ptr + at3, ks3, mask=v3 & remade)
        kd0, kd1 = (k0 * tl.exp(last - m0)[:, None]).to(op), (k1 * tl.exp(last - m1)[:, None]).to(op)
        kd2, kd3 = (k2 * tl.exp(last - m2)[:, None]).to(op), (k3 * tl.exp(last - m3)[:, None]).to(op)
        tl.store(kd_ptr + at0[:, None] * DK + dk_, kd0, mask=(v0 & kept)[:, None])
        tl.store(kd_ptr + at1[:, None] * DK + dk_, kd1, mask=(v1 & kept)[:, None])
        tl.store(kd_ptr + at2[:, None] * DK + dk_, kd2, mask=(v2 & kept)[:, None])
        tl.store(kd_ptr + at3[:, None] * DK + dk_, kd3, mask=(v3 & kept)[:, None])
        # row block by row block: q exp(gam) and the decayed causal scores (zeros above the
        # diagonal), A's blocks of the row, then w and u of the row from the rows above it
        zero = tl.zeros((16, 16), dtype=tl.float32).to(op)
        vsrc = conv_ptr + 2 * HQK * DK + h * DV + offs_v[None, :]
        q0 = _tc_q(conv_ptr, r0, v0, hk, m0, at0, qg_ptr, qs_ptr, store_q, stride_conv, q_scale, l2_eps, DK)
        _qk(q0, k0, m0, m0, at0, aqk_ptr, 0, v0, True, BF16, ON_GPU)
        tl.store(aqk_ptr + at0[:, None] * 64 + 16 + offs[None, :], zero, mask=v0[:, None])
        tl.store(aqk_ptr + at0[:, None] * 64 + 32 + offs[None, :], zero, mask=v0[:, None])
        tl.store(aqk_ptr + at0[:, None] * 64 + 48 + offs[None, :], zero, mask=v0[:, None])
        t0 = _inv16(_kk(k0, k0, be0, m0, m0, True, BF16, ON_GPU))
        x0 = k0 * (be0 * tl.exp(m0))[:, None]
        x0 = _mm(t0, x0, BF16, ON_GPU)
        tl.store(w_ptr + at0[:, None] * DK + dk_, x0.to(op), mask=v0[:, None])
        y0 = tl.load(vsrc + (r0)[:, None] * stride_conv, mask=v0[:, None], other=0.0) * be0[:, None]
        y0 = _mm(t0, y0, BF16, ON_GPU)
        tl.store(u_ptr + at0[:, None] * DV + offs_v[None, :], y0.to(op), mask=v0[:, None])
        q1 = _tc_q(
            conv_ptr, r0 + 16, v1, hk, m1, at1, qg_ptr, qs_ptr, store_q, stride_conv, q_scale, l2_eps, DK
        )
        _qk(q1, k0, m1, m0, at1, aqk_ptr, 0, v1, False, BF16, ON_GPU)
        _qk(q1, k1, m1, m1, at1, aqk_ptr, 16, v1, True, BF16, ON_GPU)
        tl.store(aqk_ptr + at1[:, None] * 64 + 32 + offs[None, :], zero, mask=v1[:, None])
        tl.store(aqk_ptr + at1[:, None] * 64 + 48 + offs[None, :], zero, mask=v1[:, None])
        a10 = _kk(k1, k0, be1, m1, m0, False, BF16, ON_GPU)
        t1 = _inv16(_kk(k1, k1, be1, m1, m1, True, BF16, ON_GPU))
        x1 = k1 * (be1 * tl.exp(m1))[:, None]
        x1 = x1 - _mm(a10, x0, BF16, ON_GPU)
        x1 = _mm(t1, x1, BF16, ON_GPU)
        tl.store(w_ptr + at1[:, None] * DK + dk_, x1.to(op), mask=v1[:, None])
        y1 = tl.load(vsrc + (r0 + 16)[:, None] * stride_conv, mask=v1[:, None], other=0.0) * be1[:, None]
        y1 = y1 - _mm(a10, y0, BF16, ON_GPU)
        y1 = _mm(t1, y1, BF16, ON_GPU)
        tl.store(u_ptr + at1[:, None] * DV + offs_v[None, :], y1.to(op), mask=v1[:, None])
        q2 = _tc_q(
            conv_ptr, r0 + 32, v2, hk, m2, at2, qg_ptr, qs_ptr, store_q, stride_conv, q_scale, l2_eps, DK
        )
        _qk(q2, k0, m2, m0, at2, aqk_ptr, 0, v2, False, BF16, ON_GPU)
        _qk(q2, k1, m2, m1, at2, aqk_ptr, 16, v2, False, BF16, ON_GPU)
        _qk(q2, k2, m2, m2, at2, aqk_ptr, 32, v2, True, BF16, ON_GPU)
        tl.store(aqk_ptr + at2[:, None] * 64 + 48 + offs[None, :], zero, mask=v2[:, None])
        a20 = _kk(k2, k0, be2, m2, m0, False, BF16, ON_GPU)
        a21 = _kk(k2, k1, be2, m2, m1, False, BF16, ON_GPU)
        t2 = _inv16(_kk(k2, k2, be2, m2, m2, True, BF16, ON_GPU))
        x2 = k2 * (be2 * tl.exp(m2))[:, None]
        x2 = x2 - _mm(a20, x0, BF16, ON_GPU)
        x2 = x2 - _mm(a21, x1, BF16, ON_GPU)
        x2 = _mm(t2, x2, BF16, ON_GPU)
        tl.store(w_ptr + at2[:, None] * DK + dk_, x2.to(op), mask=v2[:, None])
        y2 = tl.load(vsrc + (r0 + 32)[:, None] * stride_conv, mask=v2[:, None], other=0.0) * be2[:, None]
        y2 = y2 - _mm(a20, y0, BF16, ON_GPU)
        y2 = y2 - _mm(a21, y1, BF16, ON_GPU)
        y2 = _mm(t2, y2, BF16, ON_GPU)
        tl.store(u_ptr + at2[:, None] * DV + offs_v[None, :], y2.to(op), mask=v2[:, None])
        q3 = _tc_q(
            conv_ptr, r0 + 48, v3, hk, m3, at3, qg_ptr, qs_ptr, store_q, stride_conv, q_scale, l2_eps, DK
        )
        _qk(q3, k0, m3, m0, at3, aqk_ptr, 0, v3, False, BF16, ON_GPU)
        _qk(q3, k1, m3, m1, at3, aqk_ptr, 16, v3, False, BF16, ON_GPU)
        _qk(q3, k2, m3, m2, at3, aqk_ptr, 32, v3, False, BF16, ON_GPU)
        _qk(q3, k3, m3, m3, at3, aqk_ptr, 48, v3, True, BF16, ON_GPU)
        a30 = _kk(k3, k0, be3, m3, m0, False, BF16, ON_GPU)
        a31 = _kk(k3, k1, be3, m3, m1, False, BF16, ON_GPU)
        a32 = _kk(k3, k2, be3, m3, m2, False, BF16, ON_GPU)
        t3 = _inv16(_kk(k3, k3, be3, m3, m3, True, BF16, ON_GPU))
        x3 = k3 * (be3 * tl.exp(m3))[:, None]
        x3 = x3 - _mm(a30, x0, BF16, ON_GPU)
        x3 = x3 - _mm(a31, x1, BF16, ON_GPU)
        x3 = x3 - _mm(a32, x2, BF16, ON_GPU)
        x3 = _mm(t3, x3, BF16, ON_GPU)
        tl.store(w_ptr + at3[:, None] * DK + dk_, x3.to(op), mask=v3[:, None])
        y3 = tl.load(vsrc + (r0 + 48)[:, None] * stride_conv, mask=v3[:, None], other=0.0) * be3[:, None]
        y3 = y3 - _mm(a30, y0, BF16, ON_GPU)
        y3 = y3 - _mm(a31, y1, BF16, ON_GPU)
        y3 = y3 - _mm(a32, y2, BF16, ON_GPU)
        y3 = _mm(t3, y3, BF16, ON_GPU)
        tl.store(u_ptr + at3[:, None] * DV + offs_v[None, :], y3.to(op), mask=v3[:, None])


def _tf32(x, ON_GPU: tl.constexpr):
    """x as a tf32 operand: on the GPU the tensor cores read the fp32 registers at tf32's 10
    mantissa bits; the interpreter's dot multiplies in fp32, so there the low 13 bits are
    dropped by hand (truncation, the worse of truncating and rounding) and the interpreter
    tests see no more precision than the GPU has."""
    if ON_GPU:
        return x
    else:
        return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


def _mm_tf32(a, b, ON_GPU: tl.constexpr):
    """a @ b with tf32 operands and fp32 accumulation (the chunk inverse's products)."""
    if ON_GPU:
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(_tf32(a, ON_GPU), _tf32(b, ON_GPU), input_precision="ieee")


def _inv_level(d, a, part, eye, ON_GPU: tl.constexpr):
    """One level of the blocked inverse: given d = (I + a_in)^-1 for a_in, the part of the
    strictly lower triangular a inside blocks of size s (block-diagonal, blocks of s / 4),
    the inverse for a's part inside blocks of size 4 s. With n = a's entries in `part` (inside
    the 4s-blocks, outside the s-blocks) I + a_in + n = (I + a_in)(I + m), m = d n, and m is
    strictly lower triangular at the s-block level with 4 s-blocks per 4s-block, so m^4 = 0 and
    (I + m)^-1 = (I - m)(I + m^2) exactly: three products and one more for (I + m)^-1 d. The
    series has four terms (growth of a 4 x 4 block triangular solve), unlike a Neumann product
    over the 64 rows, whose terms grow binomially when the keys share a direction."""
    m = _mm_tf32(d, tl.where(part, a, 0.0), ON_GPU)
    im = eye - m
    p = im + _mm_tf32(im, _mm_tf32(m, m, ON_GPU), ON_GPU)
    return _mm_tf32(p, d, ON_GPU)


def _invert_chunk(qblocks_ptr, segs_ptr, HV: tl.constexpr):
    """This program's chunk (value head h = program 0, query block = program 1): whether it is
    live (a live record at a 64-row chunk start inside its segment), the chunk's first packed
    row, its 64 offsets, which of them lie inside the segment, their packed rows and their
    [T, HV] row index."""
    h = tl.program_id(0)
    qb = tl.program_id(1).to(tl.int64) * 3  # query block record: slot, first local index, live
    rec = segs_ptr + tl.load(qblocks_ptr + qb) * 8
    c0 = tl.load(qblocks_ptr + qb + 1)
    length = tl.load(rec + 1)
    live = (tl.load(qblocks_ptr + qb + 2) != 0) & (c0 % 64 == 0) & (c0 < length)
    offs = tl.arange(0, 64)
    valid = c0 + offs < length
    first = tl.load(rec) + c0
    rows = first + offs
    return live, h, first, offs, valid, rows, rows * HV + h


def _invert_beta(b_ptr, rows, stride_b, h, valid):
    """beta = sigmoid(b) of the chunk's rows for value head h (0 past the segment end)."""
    b = tl.load(b_ptr + rows * stride_b + h, mask=valid, other=0.0).to(tl.float32)
    return tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)


def _invert_keys(
    conv_ptr, a_ptr, ssm_a_ptr, dt_ptr, g_ptr, kd_ptr, ks_ptr, gt_ptr, rows, at, h, offs, valid,
    store_k, stride_conv, stride_a, l2_eps,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """The chunk's log decay gam (from the chunk start; rows past the end add 0) and its
    keys: gam stored, k l2-normalised, and k exp(gam_last - gam) stored (store_k) or its
    scale and gam_last stored for the walk to remake it - one build, a runtime switch of masked
    stores, so every TC_DECAYED_FORMS form computes the same bits. Returns (gam, k, k's scale)."""
    x = tl.load(a_ptr + rows * stride_a + h, mask=valid, other=0.0).to(tl.float32)
    x = x + tl.load(dt_ptr + h).to(tl.float32)
    soft = libdevice.log1p(tl.exp(x)) if ON_GPU else tl.log(1.0 + tl.exp(x))
    soft = tl.where(x > 20.0, x, soft)
    g = tl.where(valid, tl.load(ssm_a_ptr + h).to(tl.float32) * soft, 0.0)
    gam = tl.cumsum(g, axis=0)
    # through the chunk's last row: gam's last entry (rows past the end add 0), the very bits
    # the walk reads as the chunk's total decay
    last = tl.sum(tl.where(offs == 63, gam, 0.0), axis=0)
    tl.store(g_ptr + at, gam, mask=valid)
    offs_k = tl.arange(0, DK)
    hk = h // (HV // HQK)
    k = tl.load(conv_ptr + rows[:, None] * stride_conv + HQK * DK + hk * DK + offs_k[None, :],
                mask=valid[:, None], other=0.0)  # fmt: skip
    k_scale = tl.math.rsqrt(tl.sum(k * k, axis=1) + l2_eps)
    k = k * k_scale[:, None]
    kept, remade = (offs * 0 + store_k) != 0, (offs * 0 + store_k) == 0  # row-shaped (interpreter)
    decayed = (k * tl.exp(last - gam)[:, None]).to(kd_ptr.dtype.element_ty)
    tl.store(kd_ptr + at[:, None] * DK + offs_k[None, :], decayed, mask=(valid & kept)[:, None])
    tl.store(ks_ptr + at, k_scale, mask=valid & remade)
    tl.store(gt_ptr + at, tl.where(offs == 0, last, 0.0), mask=(offs == 0) & valid & remade)
    return gam, k, k_scale


def _invert_front(
    conv_ptr, b_ptr, a_ptr, ssm_a_ptr, dt_ptr, segs_ptr, qblocks_ptr, g_ptr, hidx_ptr, kd_ptr, ks_ptr, gt_ptr,
    h, first, offs, valid, rows, at, store_k, stride_conv, stride_b, stride_a, l2_eps,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """What every invert form does first for a live chunk: its number (value head 0's program),
    beta, and gam with the keys (`_invert_keys`). Returns (beta, gam, k, k's scale)."""
    if h == 0:
        _tc_chunk_number(qblocks_ptr, segs_ptr, hidx_ptr, tl.program_id(1), first)
    beta = _invert_beta(b_ptr, rows, stride_b, h, valid)
    gam, k, k_scale = _invert_keys(
        conv_ptr, a_ptr, ssm_a_ptr, dt_ptr, g_ptr, kd_ptr, ks_ptr, gt_ptr, rows, at, h, offs, valid,
        store_k, stride_conv, stride_a, l2_eps, HQK, HV, DK, ON_GPU,
    )  # fmt: skip
    return beta, gam, k, k_scale


def _invert_decay(gam, offs):
    """exp(gam_r - gam_c) on and below the diagonal (<= 1 there, where gam_r <= gam_c), 0 above
    it (masked before the exp): one decay matrix for the scores and A."""
    r, c = offs[:, None], offs[None, :]
    return tl.exp(tl.where(r >= c, gam[:, None] - gam[None, :], float("-inf")))


def _invert_a(k, beta, decay, offs, BF16: tl.constexpr, ON_GPU: tl.constexpr):
    """A, strictly lower: (k k^T scaled by beta after the product) times the decay."""
    r, c = offs[:, None], offs[None, :]
    return tl.where(r > c, (_mm(k, tl.trans(k), BF16, ON_GPU) * beta[:, None]) * decay, 0.0)


def _invert_scores(
    conv_ptr, qg_ptr, qs_ptr, aqk_ptr, rows, at, h, offs, valid, k, decay, gam, store_q, stride_conv,
    q_scale, l2_eps,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, BF16: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """The queries (l2-normalised and scaled; q exp(gam) stored (store_q), else its scale, for
    the outputs kernel to remake it) and the decayed causal scores exp(gam_r - gam_c) q_r.k_c
    (c <= r; zeros above the diagonal), stored."""
    op = qg_ptr.dtype.element_ty
    offs_k = tl.arange(0, DK)
    hk = h // (HV // HQK)
    q = tl.load(
        conv_ptr + rows[:, None] * stride_conv + hk * DK + offs_k[None, :], mask=valid[:, None], other=0.0
    )
    q_norm = tl.math.rsqrt(tl.sum(q * q, axis=1) + l2_eps) * q_scale
    q = q * q_norm[:, None]
    kept = (offs * 0 + store_q) != 0  # as k's (store_q: stored, else made by the outputs)
    tl.store(qg_ptr + at[:, None] * DK + offs_k[None, :], (q * tl.exp(gam)[:, None]).to(op),
             mask=(valid & kept)[:, None])  # fmt: skip
    tl.store(qs_ptr + at, q_norm, mask=valid & ~kept)
    scores = _mm(q, tl.trans(k), BF16, ON_GPU) * decay
    tl.store(aqk_ptr + at[:, None] * 64 + offs[None, :], scores.to(op), mask=valid[:, None])


def _invert_t(a, src, valid, offs, LOADED: tl.constexpr, ON_GPU: tl.constexpr):
    """T = (I + A)^-1: blocks of 4 by (I - B)(I + B^2) (B^4 = 0), then two levels of
    `_inv_level` (4 -> 16 -> 64 rows). A is the matrix `a`, or (LOADED) read from `src` (a
    [64, 64] fp32 pointer block, rows past the segment end as zeros: what `a` holds there) one
    part where each level uses it - the same values, and A is never live whole (the inverse
    kernel's registers: 152 against 198 in the bf16 sm_90 build with the three parts loaded up front)."""
    r, c = offs[:, None], offs[None, :]
    eye = tl.where(r == c, 1.0, 0.0)
    in4 = (r // 4) == (c // 4)
    if LOADED:
        b4 = tl.where(in4, tl.load(src, mask=valid[:, None] & in4, other=0.0), 0.0)
    else:
        b4 = tl.where(in4, a, 0.0)
    ib = eye - b4
    d = ib + _mm_tf32(ib, _mm_tf32(b4, b4, ON_GPU), ON_GPU)
    part = ((r // 16) == (c // 16)) & ~in4
    if LOADED:
        d = _inv_level(d, tl.load(src, mask=valid[:, None] & part, other=0.0), part, eye, ON_GPU)
    else:
        d = _inv_level(d, a, part, eye, ON_GPU)
    part = (r // 16) != (c // 16)
    if LOADED:
        return _inv_level(d, tl.load(src, mask=valid[:, None] & part, other=0.0), part, eye, ON_GPU)
    else:
        return _inv_level(d, a, part, eye, ON_GPU)


def _invert_wu(
    conv_ptr, w_ptr, u_ptr, rows, at, h, valid, t_op, k_scale, beta, gam, stride_conv,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BF16: tl.constexpr,
    ON_GPU: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    """w = T (beta exp(gam) k) and u = T (beta v), BW columns at a time (a [64, 128] fp32
    accumulator and its operand would hold 128 registers per thread at 4 warps); k reloaded
    from L1/L2 and scaled by its stored scale rather than kept live."""
    op = w_ptr.dtype.element_ty
    hk = h // (HV // HQK)
    src = conv_ptr + rows[:, None] * stride_conv
    for j in tl.static_range(DK // BW):
        offs_j = j * BW + tl.arange(0, BW)
        k = tl.load(src + HQK * DK + hk * DK + offs_j[None, :], mask=valid[:, None], other=0.0)
        k = (k * k_scale[:, None]) * (beta * tl.exp(gam))[:, None]
        w = _mm(t_op, k, BF16, ON_GPU)
        tl.store(w_ptr + at[:, None] * DK + offs_j[None, :], w.to(op), mask=valid[:, None])
    for j in tl.static_range(DV // BW):
        offs_j = j * BW + tl.arange(0, BW)
        v = tl.load(src + 2 * HQK * DK + h * DV + offs_j[None, :], mask=valid[:, None], other=0.0)
        u = _mm(t_op, v * beta[:, None], BF16, ON_GPU)
        tl.store(u_ptr + at[:, None] * DV + offs_j[None, :], u.to(op), mask=valid[:, None])


def _forest_gdn_tc_invert_kernel(
    conv_ptr, b_ptr, a_ptr, ssm_a_ptr, dt_ptr, segs_ptr, qblocks_ptr,
    w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, g_ptr, hidx_ptr, qs_ptr, ks_ptr, gt_ptr, store_q, store_k,
    stride_conv, stride_b, stride_a, q_scale, l2_eps,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BF16: tl.constexpr, ON_GPU: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    """Program (value head, query block) - the value heads of a chunk adjacent, so the three
    that read one key head's q and k find them in L2: the same products as
    `_forest_gdn_tc_prep_kernel`, made with whole-chunk matrix products instead of a chain of
    16-row blocks. The raw scores k k^T and q k^T are one 64 x 64 product each (scaled by beta
    and the decay after the product, as the block form does); T = (I + A)^-1 of the whole
    chunk comes from A alone in three levels of blocks (4, 16, 64 rows: `_inv_level`), ten
    64 x 64 products in tf32 (enough: w and u are then rounded to bf16 with T, and in a
    float64 study of 30 chunks they came out as close to exact as the block form's); then
    w = T (beta exp(gam) k) and u = T (beta v) are one product each (in 64-column blocks) at
    the operand precision. The chain is 16 products on the tensor cores (wgmma) instead of 64
    16-row ones (24 of them fp32 FMA for the diagonal inverses), on 4 warps instead of 8."""
    live, h, first, offs, valid, rows, at = _invert_chunk(qblocks_ptr, segs_ptr, HV)
    if live:
        beta, gam, k, k_scale = _invert_front(
            conv_ptr, b_ptr, a_ptr, ssm_a_ptr, dt_ptr, segs_ptr, qblocks_ptr, g_ptr, hidx_ptr, kd_ptr, ks_ptr,
            gt_ptr, h, first, offs, valid, rows, at, store_k, stride_conv, stride_b, stride_a, l2_eps,
            HQK, HV, DK, ON_GPU,
        )  # fmt: skip
        decay = _invert_decay(gam, offs)
        a = _invert_a(k, beta, decay, offs, BF16, ON_GPU)
        _invert_scores(
            conv_ptr, qg_ptr, qs_ptr, aqk_ptr, rows, at, h, offs, valid, k, decay, gam, store_q, stride_conv,
            q_scale, l2_eps, HQK, HV, DK, BF16, ON_GPU,
        )  # fmt: skip
        t = _invert_t(a, w_ptr, valid, offs, False, ON_GPU)  # (w_ptr: not read)
        t_op = t.to(w_ptr.dtype.element_ty) if BF16 else t
        _invert_wu(conv_ptr, w_ptr, u_ptr, rows, at, h, valid, t_op, k_scale, beta, gam, stride_conv,
                   HQK, HV, DK, DV, BF16, ON_GPU, BW)  # fmt: skip


# ----------------------------------------------------------- the invert form in three kernels
# `_forest_gdn_tc_invert_kernel` split where its live values are fewest: after A (the scores
# kernel), after T (the inverse kernel), and the w / u products (the w, u kernel). Each runs
# the fused kernel's ops on the same values in the same order, so every stored tensor keeps
# its bits; what passes between them goes through fp32 or operand-dtype workspaces exactly.
def _forest_gdn_tc_invert_scores_kernel(
    conv_ptr, b_ptr, a_ptr, ssm_a_ptr, dt_ptr, segs_ptr, qblocks_ptr,
    qg_ptr, kd_ptr, aqk_ptr, g_ptr, hidx_ptr, qs_ptr, ks_ptr, gt_ptr, am_ptr, kn_ptr, store_q, store_k,
    stride_conv, stride_b, stride_a, q_scale, l2_eps,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BF16: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (value head, query block), the first of the "invert_split" form's three: the
    fused `_forest_gdn_tc_invert_kernel` up to A, its ops on the same values (beta, gam, q and
    k with their row sums, every store it makes before the inverse; A is made before q is
    loaded, so k k^T is dead by then: 149 registers, not 195, in the bf16 sm_90 build), and A
    (fp32, strictly lower: row r of the chunk at packed row r, 64 columns) and k's l2 scale
    per row (fp32) to the workspaces am / kn for the inverse and the w, u kernel. The row sums
    stay here, in the fused kernel's layout at its warps, so the later kernels redo no
    reduction (whose order would follow their own layouts). Only the chunk's live rows are
    stored (its rows past the segment end are another segment's or padding); the readers
    load those as zeros, the values the fused kernel holds there."""
    live, h, first, offs, valid, rows, at = _invert_chunk(qblocks_ptr, segs_ptr, HV)
    if live:
        beta, gam, k, k_scale = _invert_front(
            conv_ptr, b_ptr, a_ptr, ssm_a_ptr, dt_ptr, segs_ptr, qblocks_ptr, g_ptr, hidx_ptr, kd_ptr, ks_ptr,
            gt_ptr, h, first, offs, valid, rows, at, store_k, stride_conv, stride_b, stride_a, l2_eps,
            HQK, HV, DK, ON_GPU,
        )  # fmt: skip
        tl.store(kn_ptr + at, k_scale, mask=valid)
        decay = _invert_decay(gam, offs)
        a = _invert_a(k, beta, decay, offs, BF16, ON_GPU)
        tl.store(am_ptr + at[:, None] * 64 + offs[None, :], a, mask=valid[:, None])
        _invert_scores(
            conv_ptr, qg_ptr, qs_ptr, aqk_ptr, rows, at, h, offs, valid, k, decay, gam, store_q, stride_conv,
            q_scale, l2_eps, HQK, HV, DK, BF16, ON_GPU,
        )  # fmt: skip


def _forest_gdn_tc_invert_inverse_kernel(
    segs_ptr, qblocks_ptr, am_ptr, tm_ptr, HV: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (value head, query block), the second of the "invert_split" form's three: the
    chunk's A from the scores kernel's workspace (its rows past the segment end read as zeros,
    as the fused kernel holds them; each level's part loaded where the level uses it, the
    values tl.where(part, a, 0) gives, so A is not live throughout: 152 registers, not 185),
    T = (I + A)^-1 by the fused kernel's blocked inverse - the same ten tf32 products and
    elementwise ops in the same order - and T in the operand
    dtype the fused kernel feeds its w and u products (bf16, or fp32 for tf32 operands) to
    the workspace tm, at the chunk's live rows."""
    live, h, first, offs, valid, rows, at = _invert_chunk(qblocks_ptr, segs_ptr, HV)
    if live:
        block = at[:, None] * 64 + offs[None, :]
        t = _invert_t(am_ptr, am_ptr + block, valid, offs, True, ON_GPU)  # (the first: not read)
        tl.store(tm_ptr + block, t.to(tm_ptr.dtype.element_ty), mask=valid[:, None])


def _forest_gdn_tc_invert_wu_kernel(
    conv_ptr, b_ptr, segs_ptr, qblocks_ptr, w_ptr, u_ptr, g_ptr, kn_ptr, tm_ptr, stride_conv, stride_b,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BF16: tl.constexpr, ON_GPU: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    """Program (value head, query block), the last of the "invert_split" form's three:
    w = T (beta exp(gam) k) and u = T (beta v) as the fused kernel makes them - BW columns at a
    time, the same elementwise ops in the same order - from T (the inverse kernel's
    workspace), gam (as the scores kernel stored it), k's l2 scale (its workspace: no row sum
    here) and beta (elementwise from b, the same bits). Rows past the segment end read zeros
    for T, gam and the scale: their operand rows are zeros either way (k and v are masked,
    beta is 0), and a product's live row reads only its own row of T."""
    live, h, first, offs, valid, rows, at = _invert_chunk(qblocks_ptr, segs_ptr, HV)
    if live:
        beta = _invert_beta(b_ptr, rows, stride_b, h, valid)
        gam = tl.load(g_ptr + at, mask=valid, other=0.0)
        k_scale = tl.load(kn_ptr + at, mask=valid, other=0.0)
        t_op = tl.load(tm_ptr + at[:, None] * 64 + offs[None, :], mask=valid[:, None], other=0.0)
        _invert_wu(conv_ptr, w_ptr, u_ptr, rows, at, h, valid, t_op, k_scale, beta, gam, stride_conv,
                   HQK, HV, DK, DV, BF16, ON_GPU, BW)  # fmt: skip


def _decayed(conv_ptr, scale_ptr, g_ptr, rows, at, valid, g_last, col, stride_conv, DK: tl.constexpr,
             KEYS: tl.constexpr, OP: tl.constexpr):  # fmt: skip
    """The "recomputed" TC_DECAYED_FORMS form's decayed rows [64, DK] in the operand dtype OP:
    x the conv rows' columns col .. col + DK - 1 times the l2-norm scale the prep stored for
    each row, then KEYS: k exp(g_last - gam) (g_last the chunk's total decay as the prep
    computed it for its stored form, kept at the chunk's first row), else q exp(gam) (q_scale
    is in q's stored scale). Elementwise only, the prep's ops in its order - the row sums stay
    in the prep, whose layout fixes their order - so the values are the ones that prep build
    would have stored; rows past the segment end are zeros, as the stored form's masked loads
    read them."""
    offs_k = tl.arange(0, DK)
    x = tl.load(
        conv_ptr + rows[:, None] * stride_conv + col + offs_k[None, :], mask=valid[:, None], other=0.0
    )
    x = x * tl.load(scale_ptr + at, mask=valid, other=0.0)[:, None]
    gam = tl.load(g_ptr + at, mask=valid, other=0.0)
    if KEYS:
        return (x * tl.exp(g_last - gam)[:, None]).to(OP)
    else:
        return (x * tl.exp(gam)[:, None]).to(OP)


def _walk_start(
    base_ptr, segs_ptr, slot, h, offs_k, offs_v, level, layer_off, DK: tl.constexpr, DV: tl.constexpr
):
    """A chunk walk's start for one (segment slot, value head, value block): whether the slot
    holds a live segment of `level`, its first row and length, where its final state goes, the
    state block's offsets, and the block S [DK, BV] it starts from (zeros without a state in)."""
    rec = segs_ptr + slot.to(tl.int64) * 8
    run = (tl.load(rec + 7) != 0) & (tl.load(rec + 2) == level)
    blk = layer_off + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    has_in = tl.where(run, tl.load(rec + 4), 0)  # a slot of another level reads no state
    imask = (offs_k[:, None] * 0 + offs_v[None, :] * 0 + has_in) != 0  # block-shaped (interpreter)
    s = tl.load(base_ptr + tl.load(rec + 3) + blk, mask=imask, other=0.0)
    return run, tl.load(rec), tl.load(rec + 1), tl.load(rec + 5), blk, s


def _walk_step(s, w, u, kd, g_last, BF16: tl.constexpr, ON_GPU: tl.constexpr):
    """One 64-token chunk of the walk, shared by the fused and the split form so both carry the
    same state bits: the start state in the operand dtype S_op, the delta-rule updates
    U = u - w S_op (operand dtype), and the next state exp(gam_last) S + (k exp(gam_last - gam))^T U."""
    s_op = s.to(w.dtype)
    un_op = (u.to(tl.float32) - _mm(w, s_op, BF16, ON_GPU)).to(w.dtype)
    return s_op, un_op, s * tl.exp(g_last) + _mm(tl.trans(kd), un_op, BF16, ON_GPU)


def _forest_gdn_tc_kernel(
    base_ptr, segs_ptr, o_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, g_ptr, level, layer_off,
    HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BF16: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (segment slot, value head, value block) of one level: the serial part of the
    chunked recurrence, 64 tokens per step from `_forest_gdn_tc_prep_kernel`'s products, with
    the state block S [DK, BV] in fp32 registers: U = u - w S, o = (q exp(gam)) S + scores U,
    S <- exp(gam_last) S + (k exp(gam_last - gam))^T U."""
    slot = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, DK)
    offs_c = tl.arange(0, 64)
    run, tok_lo, length, state_out, blk, s = _walk_start(
        base_ptr, segs_ptr, slot, h, offs_k, offs_v, level, layer_off, DK, DV
    )
    if run:
        for c0 in range(0, length, 64):
            valid = (c0 + offs_c) < length
            at = (tok_lo + c0 + offs_c) * HV + h
            w = tl.load(w_ptr + at[:, None] * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
            qg = tl.load(qg_ptr + at[:, None] * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
            kd = tl.load(kd_ptr + at[:, None] * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
            aqk = tl.load(aqk_ptr + at[:, None] * 64 + offs_c[None, :], mask=valid[:, None], other=0.0)
            u = tl.load(u_ptr + at[:, None] * DV + offs_v[None, :], mask=valid[:, None], other=0.0)
            last = tl.minimum(length - c0, 64) - 1
            g_last = tl.load(g_ptr + (tok_lo + c0 + last) * HV + h)
            s_op, un_op, s = _walk_step(s, w, u, kd, g_last, BF16, ON_GPU)
            o = _mm(qg, s_op, BF16, ON_GPU) + _mm(aqk, un_op, BF16, ON_GPU)
            tl.store(o_ptr + at[:, None] * DV + offs_v[None, :], o, mask=valid[:, None])
        tl.store(base_ptr + state_out + blk, s)


def _forest_gdn_tc_walk_kernel(
    base_ptr, segs_ptr, w_ptr, u_ptr, kd_ptr, g_ptr, hidx_ptr, hs_ptr, vn_ptr, level, layer_off, NH,
    conv_ptr, ks_ptr, gt_ptr, stride_conv,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    BF16: tl.constexpr, ON_GPU: tl.constexpr, RECOMPUTE: tl.constexpr,
):  # fmt: skip
    """Program (segment slot, value head, value block) of one level, the split form's serial
    part: per 64-token chunk only the two products that feed the state - U = u - w S and
    S <- exp(gam_last) S + (k exp(gam_last - gam))^T U - storing the chunk's start state S (in the
    operand dtype, as the dots read it) at its chunk number and U at its rows, so that
    `_forest_gdn_tc_out_kernel` makes the outputs of every chunk in parallel afterwards.
    RECOMPUTE: k exp(gam_last - gam) is made here from the conv rows, k's scale, gam and the
    chunk's gam_last as the prep had them (`_decayed`) instead of read from the prep's store:
    the same values, from 4 bytes a key element read from the conv rows (shared in L2 by the
    value heads of a key head and their value blocks) instead of 2 bytes per value head
    written by the prep and read back here."""
    slot = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, DK)
    offs_c = tl.arange(0, 64)
    run, tok_lo, length, state_out, blk, s = _walk_start(
        base_ptr, segs_ptr, slot, h, offs_k, offs_v, level, layer_off, DK, DV
    )
    if run:
        hblk = h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
        zero = offs_k[:, None] * 0 + offs_v[None, :] * 0  # block-shaped masks (interpreter)
        for c0 in range(0, length, 64):
            valid = (c0 + offs_c) < length
            at = (tok_lo + c0 + offs_c) * HV + h
            idx = tl.load(hidx_ptr + tok_lo + c0).to(tl.int64)
            w = tl.load(w_ptr + at[:, None] * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
            u = tl.load(u_ptr + at[:, None] * DV + offs_v[None, :], mask=valid[:, None], other=0.0)
            last = tl.minimum(length - c0, 64) - 1
            g_last = tl.load(g_ptr + (tok_lo + c0 + last) * HV + h)
            if RECOMPUTE:
                kd = _decayed(
                    conv_ptr, ks_ptr, g_ptr, tok_lo + c0 + offs_c, at, valid,
                    tl.load(gt_ptr + (tok_lo + c0) * HV + h), (HQK + h // (HV // HQK)) * DK, stride_conv, DK,
                    True, w_ptr.dtype.element_ty,
                )  # fmt: skip
            else:
                kd = tl.load(kd_ptr + at[:, None] * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
            s_op, un_op, s = _walk_step(s, w, u, kd, g_last, BF16, ON_GPU)
            tl.store(hs_ptr + idx * HV * DK * DV + hblk, s_op, mask=(zero + idx) < NH)
            tl.store(vn_ptr + at[:, None] * DV + offs_v[None, :], un_op, mask=valid[:, None])
        tl.store(base_ptr + state_out + blk, s)


def _forest_gdn_tc_out_kernel(
    segs_ptr, qblocks_ptr, o_ptr, qg_ptr, aqk_ptr, hidx_ptr, hs_ptr, vn_ptr, level, NH,
    conv_ptr, qs_ptr, g_ptr, rows_ptr, stride_conv, T, num_q,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    BF16: tl.constexpr, ON_GPU: tl.constexpr, RECOMPUTE: tl.constexpr, PAD_ZEROS: tl.constexpr,
    BR: tl.constexpr,
):  # fmt: skip
    """Program (query block, value head, value block): if the block starts a 64-token chunk of a
    live segment of `level` (< 0: of any level), the chunk's outputs
    o = (q exp(gam)) S_start + scores U from the split walk's stored start state and updates -
    the same operands and products as the fused walk's, every chunk of every segment at once.
    RECOMPUTE: q exp(gam) is made here from the conv rows, q's scale and gam (`_decayed`, the
    same values) instead of read from the prep's store. PAD_ZEROS: program i also writes zeros
    to the padding rows (rows-table live 0) among packed rows i BR .. i BR + BR - 1 (and every
    num_q BR rows after, should the table hold fewer than T / BR query blocks), so `o` needs no
    memset: a live row is written by its chunk, a padding row here, each exactly once."""
    pid_q = tl.program_id(0)
    qb = pid_q.to(tl.int64) * 3
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    # the live flags of this program's first block of BR rows, loaded beside the query block's
    # record (not after it: most programs only read the two records and return, so one more
    # round trip in their chain would show); the zeros are stored last
    offs_r = tl.arange(0, BR)
    r = (pid_q * BR + offs_r).to(tl.int64)
    inside = (r < T) & PAD_ZEROS
    dead = inside & (tl.load(rows_ptr + r * 4 + 2, mask=inside, other=1) == 0)
    slot = tl.load(qblocks_ptr + qb)
    c0 = tl.load(qblocks_ptr + qb + 1)
    rec = segs_ptr + slot * 8
    length = tl.load(rec + 1)
    seg_level = tl.load(rec + 2)
    ok = (tl.load(qblocks_ptr + qb + 2) != 0) & (tl.load(rec + 7) != 0) & (c0 % 64 == 0) & (c0 < length)
    if ok & ((level < 0) | (seg_level == level)):
        tok_lo = tl.load(rec)
        offs_k = tl.arange(0, DK)
        offs_c = tl.arange(0, 64)
        idx = tl.load(hidx_ptr + tok_lo + c0).to(tl.int64)
        valid = (c0 + offs_c) < length
        at = (tok_lo + c0 + offs_c) * HV + h
        hmask = (offs_k[:, None] * 0 + offs_v[None, :] * 0 + idx) < NH
        hs = tl.load(
            hs_ptr + (idx * HV + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :], mask=hmask, other=0.0
        )
        if RECOMPUTE:
            qg = _decayed(
                conv_ptr, qs_ptr, g_ptr, tok_lo + c0 + offs_c, at, valid, 0.0, (h // (HV // HQK)) * DK,
                stride_conv, DK, False, vn_ptr.dtype.element_ty,
            )  # fmt: skip
        else:
            qg = tl.load(qg_ptr + at[:, None] * DK + offs_k[None, :], mask=valid[:, None], other=0.0)
        aqk = tl.load(aqk_ptr + at[:, None] * 64 + offs_c[None, :], mask=valid[:, None], other=0.0)
        vn = tl.load(vn_ptr + at[:, None] * DV + offs_v[None, :], mask=valid[:, None], other=0.0)
        o = _mm(qg, hs, BF16, ON_GPU) + _mm(aqk, vn, BF16, ON_GPU)
        tl.store(o_ptr + at[:, None] * DV + offs_v[None, :], o, mask=valid[:, None])
    if PAD_ZEROS:
        zeros = tl.zeros((BR, BV), dtype=tl.float32)
        tl.store(o_ptr + (r[:, None] * HV + h) * DV + offs_v[None, :], zeros, mask=dead[:, None])
        for r0 in range((pid_q + num_q) * BR, T, num_q * BR):  # a table of fewer than T / BR blocks
            r = (r0 + offs_r).to(tl.int64)
            dead = (r < T) & (tl.load(rows_ptr + r * 4 + 2, mask=r < T, other=1) == 0)
            tl.store(o_ptr + (r[:, None] * HV + h) * DV + offs_v[None, :], zeros, mask=dead[:, None])


_gdn = kernel(_forest_gdn_kernel)
_gdn_prep = kernel(_forest_gdn_prep_kernel)
_mm = helper(_mm)  # type: ignore[assignment]
_walk_start = helper(_walk_start)  # type: ignore[assignment]
_decayed = helper(_decayed)  # type: ignore[assignment]
_walk_step = helper(_walk_step)  # type: ignore[assignment]
_tc_rows = helper(_tc_rows)  # type: ignore[assignment]
_tc_q = helper(_tc_q)  # type: ignore[assignment]
_inv16 = helper(_inv16)  # type: ignore[assignment]
_kk = helper(_kk)  # type: ignore[assignment]
_qk = helper(_qk)  # type: ignore[assignment]
_tc_chunk_number = helper(_tc_chunk_number)  # type: ignore[assignment]
_tf32 = helper(_tf32)  # type: ignore[assignment]
_mm_tf32 = helper(_mm_tf32)  # type: ignore[assignment]
_inv_level = helper(_inv_level)  # type: ignore[assignment]
_invert_chunk = helper(_invert_chunk)  # type: ignore[assignment]
_invert_beta = helper(_invert_beta)  # type: ignore[assignment]
_invert_keys = helper(_invert_keys)  # type: ignore[assignment]
_invert_front = helper(_invert_front)  # type: ignore[assignment]
_invert_decay = helper(_invert_decay)  # type: ignore[assignment]
_invert_a = helper(_invert_a)  # type: ignore[assignment]
_invert_scores = helper(_invert_scores)  # type: ignore[assignment]
_invert_t = helper(_invert_t)  # type: ignore[assignment]
_invert_wu = helper(_invert_wu)  # type: ignore[assignment]
_gdn_tc_prep = kernel(_forest_gdn_tc_prep_kernel)
_gdn_tc_invert = kernel(_forest_gdn_tc_invert_kernel)
_gdn_tc_invert_scores = kernel(_forest_gdn_tc_invert_scores_kernel)
_gdn_tc_invert_inverse = kernel(_forest_gdn_tc_invert_inverse_kernel)
_gdn_tc_invert_wu = kernel(_forest_gdn_tc_invert_wu_kernel)
_gdn_tc = kernel(_forest_gdn_tc_kernel)
_gdn_tc_walk = kernel(_forest_gdn_tc_walk_kernel)
_gdn_tc_out = kernel(_forest_gdn_tc_out_kernel)


# ------------------------------------------------------------------------ table checks
def _check_base(base: torch.Tensor, like: torch.Tensor) -> None:
    if base.dtype != torch.float32 or base.dim() != 1 or base.stride(0) != 1:
        raise ValueError(f"base must be a 1-D contiguous fp32 tensor, got {base.dtype} {tuple(base.shape)}")
    if base.device != like.device:
        raise ValueError(f"base is on {base.device}, the inputs on {like.device}")


def _check_table(name: str, table: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if table.dtype != torch.int64 or tuple(table.shape) != shape or not table.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous int64 {list(shape)}, got {table.dtype} {tuple(table.shape)}"
        )
    if table.device != like.device:
        raise ValueError(f"{name} is on {table.device}, the inputs on {like.device}")


def _check_block(what: str, s: int, off: int, size: int, base: torch.Tensor) -> None:
    if off < 0 or off + size > base.numel():
        raise ValueError(
            f"segment slot {s}: {what} block [{off}, {off + size}) lies outside base "
            f"({base.numel()} elements)"
        )


def _check_segments(segs: torch.Tensor, t: int, *, level: int | None = None) -> list[list[int]]:
    """Host-side checks of the live segment records (of one level, if given); returns them all."""
    records = segs.tolist()
    for s, r in enumerate(records):
        if not r[SEG_LIVE] or (level is not None and r[SEG_LEVEL] != level):
            continue
        lo, n = r[SEG_TOK_LO], r[SEG_LENGTH]
        if lo < 0 or n < 0 or lo + n > t:
            raise ValueError(f"segment slot {s}: rows [{lo}, {lo + n}) do not fit the T={t} packed rows")
        if r[SEG_LEVEL] < 0:
            raise ValueError(f"segment slot {s}: level {r[SEG_LEVEL]} is negative")
    return records


def _check_conv_tables(
    rows: torch.Tensor,
    segs: torch.Tensor,
    conv_src: torch.Tensor,
    base: torch.Tensor,
    layer_off: int,
    c: int,
    w: int,
    in_base: bool,
) -> None:
    t = rows.shape[0]
    records = _check_segments(segs, t)
    tail = c * (w - 1)
    for i, (s, local, live, _) in enumerate(rows.tolist()):
        if not live:
            continue
        if not 0 <= s < len(records) or not records[s][SEG_LIVE]:
            raise ValueError(f"live row {i} names segment slot {s}, which is not a live slot")
        lo, n = records[s][SEG_TOK_LO], records[s][SEG_LENGTH]
        if not 0 <= local < n or lo + local != i:
            raise ValueError(
                f"live row {i} says local index {local} of slot {s}, whose rows are [{lo}, {lo + n})"
            )
    live_rows = rows[:, ROW_LIVE].tolist()
    for s, (r, srcs) in enumerate(zip(records, conv_src.tolist(), strict=True)):
        if not r[SEG_LIVE]:
            continue
        lo, n = r[SEG_TOK_LO], r[SEG_LENGTH]
        if not all(live_rows[lo : lo + n]):
            raise ValueError(f"segment slot {s}: its rows [{lo}, {lo + n}) are not all live")
        if in_base:
            _check_block("conv_out", s, r[SEG_CONV_OUT] + layer_off, tail, base)
        for k, (kind, value) in enumerate(srcs):
            if kind == CONV_ROW:
                if not 0 <= value < t:
                    raise ValueError(f"segment slot {s}: conv_src[{k}] names row {value}, outside [0, {t})")
            elif kind == CONV_TAIL:
                if in_base:
                    _check_block(f"conv_src[{k}] tail", s, value + layer_off, tail - (w - 2), base)
            elif kind != CONV_ZERO:
                raise ValueError(
                    f"segment slot {s}: conv_src[{k}] has kind {kind}, not CONV_ZERO/CONV_ROW/CONV_TAIL"
                )


# ------------------------------------------------------------------------ the conv
def forest_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    base: torch.Tensor,
    rows: torch.Tensor,
    segs: torch.Tensor,
    conv_src: torch.Tensor,
    layer_off: int,
    *,
    backend: Backend = "triton",
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of all packed pre-conv inputs x [T, C]: fp32 [T, C].

    weight [C, W] (taps oldest to newest, W >= 2); base fp32 1-D; rows [T, ROW_FIELDS],
    segs [S, SEG_FIELDS] and conv_src [S, W-1, 2] int64 tables (`engine.kernels.forest_tables`);
    layer_off: element offset of this layer inside every tail block (j * C * (W-1) for GDN layer
    j). Also writes every live segment's final tail [C, W-1] to base + conv_out + layer_off.
    Padding rows (live 0) get zeros. Table contents are checked when the tables are on the CPU.
    """
    if x.dim() != 2 or not x.dtype.is_floating_point:
        raise ValueError(f"x must be a float tensor [T, C], got {x.dtype} {tuple(x.shape)}")
    t, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 2:
        raise ValueError(f"conv weight must be [{c}, W >= 2], got {tuple(weight.shape)}")
    w = weight.shape[1]
    _check_base(base, x)
    _check_table("rows", rows, (t, ROW_FIELDS), x)
    if segs.dim() != 2 or segs.shape[0] < 1:
        raise ValueError(f"segs must be [S >= 1, {SEG_FIELDS}], got {tuple(segs.shape)}")
    s = segs.shape[0]
    _check_table("segs", segs, (s, SEG_FIELDS), x)
    _check_table("conv_src", conv_src, (s, w - 1, 2), x)
    if layer_off < 0:
        raise ValueError(f"layer_off must be >= 0, got {layer_off}")
    reference = not use_triton(backend, x)
    if segs.device.type == "cpu":
        _check_conv_tables(rows, segs, conv_src, base, layer_off, c, w, in_base=reference)
    if reference:
        return forest_conv_reference(x, weight, base, rows, segs, conv_src, layer_off)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(t, c, dtype=torch.float32, device=x.device)
    t_blocks = cdiv(t, CONV_BLOCK_T)
    _conv[(t_blocks + cdiv(s, CONV_BLOCK_T), cdiv(c, CONV_BLOCK_C))](
        x, weight.contiguous(), base, rows, segs, conv_src, y,
        layer_off, t, c, s, x.stride(0), y.stride(0), t_blocks,
        W=w, BT=CONV_BLOCK_T, BC=CONV_BLOCK_C, BG=min(CONV_GENERAL_ROWS, CONV_BLOCK_T),
        num_warps=CONV_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return y


# ------------------------------------------------------------------------ the recurrence
GDN_DOTS = ("ieee", "tf32", "bf16")  # precisions of the chunked form's matrix products
TC_CHUNK = 64  # the tensor-core form: 64-token chunks, bf16 or tf32 operands, fp32 accumulation
TC_DOTS = ("tf32", "bf16")  # the operand precisions of the TC_CHUNK form (chunks 16/32: ieee, tf32)
TC_WARPS = 4
TC_PREP_WARPS = 8
# The chunk-64 prep's forms: "blocks" (shipped: 16-row blocks by forward substitution, one
# program per chunk and value head over ~60 small products, mostly fp32 FMA) and "invert" (the
# whole chunk's 64 x 64 products and a blocked inverse on the tensor cores). Both are exact
# forms of the same products; their bits differ (other rounding points). TC_PREP_FORM is what
# forest_gdn_prep(chunk=64) runs unless told; the GPU timings decide it.
# "invert_split": the invert form in three kernels (scores and A, the inverse, w and u) with
# workspaces between them, the fused kernel's ops on the same values: the same bits (tested),
# fewer live registers per kernel, so more programs in flight on a chain of dependent products.
TC_PREP_FORMS = ("blocks", "invert", "invert_split")
TC_PREP_FORM = "blocks"
TC_INVERT_WARPS = 4
# The engine (`ForestBody(gdn_prep="invert")`, and "auto" where it picks invert) runs the
# invert form as "invert_split" when this is set: the same bits, so a setting of time alone
# (bench_engine's "tc64inv-invertsplit" variant sets it).
TC_INVERT_SPLIT = False
# ... and only in passes of at least this many rows (the bucket's): three launches where one did
# may cost more than they save at (a)'s 256 rows while paying at (c)'s 8,192, and since both forms
# give the same bits the choice may follow the batch. 0: every pass.
TC_INVERT_SPLIT_MIN_ROWS = 0
# the split form's warps: (scores, inverse, w and u); prep_warps, when given, replaces the first
# (why 4 each: `_invert_split`)
TC_INVERT_SPLIT_WARPS = (4, 4, 4)
# The invert kernel's compiled build for heads whose sizes are not multiples of 64 (w and u in
# 16-column blocks: the tiny test heads) faulted with an illegal address on the H200
# (2026-12-02, bf16, dk = dv = 16; the 27B heads, 64-column blocks, ran and matched the blocks
# form's error). Until that is understood the invert form runs compiled only on such heads; the
# interpreter (CPU tests) still runs both widths.
INVERT_HEAD_MULTIPLE = 64


def invert_compiles_for(dk: int, dv: int) -> bool:
    """Whether the invert prep form may run compiled at these head sizes (see above)."""
    return dk % INVERT_HEAD_MULTIPLE == 0 and dv % INVERT_HEAD_MULTIPLE == 0


TC_STAGES = {"bf16": 2, "tf32": 1}  # bf16: the loads of chunk c + 1 overlap chunk c's products
TC_WALKS = ("split", "fused")  # the serial walk alone + a parallel outputs launch, or both in the walk
TC_WALK_BV = 32  # value columns per split-walk program (48 heads x 4 = 192 programs at 27B)
TC_OUT_BV = 64  # value columns per outputs program
TC_WALK_WARPS = {"bf16": 4, "tf32": 8}  # tf32 at 4 warps: 255 registers and 24 B of spills
# Where the split walk's decayed keys k exp(gam_last - gam) and the outputs' decayed queries
# q exp(gam) come from (TC_DECAYED_FORMS): "stored" - the prep writes them ([T, HV, dk] each in
# the operand dtype: 2 x 100 MB at T = 8,192 and the 27B heads, each read back once);
# "recomputed_q" - the outputs kernel makes q exp(gam), the walk reads k's stored;
# "recomputed" - both are made where they are read, from the conv rows (fp32 q and k of the
# key head, shared by its value heads in L2), the l2-norm scale per row and the decay the prep
# stored (4 bytes a row each). Only elementwise ops are redone, the prep's in its order, and the
# prep is one build for every form (masked stores switched at run time), so every form gives
# the same bits. The fused walk reads them stored. The default stays "stored", the form the H200
# has timed, until ops/device/gdn_check.sh times the others (2026-12-02 session 9: built and
# tested in the interpreter, bits equal; the GPU was not lent in time to time them). The walk
# with k remade holds 236 registers against 144, so it may lose what the bytes save.
TC_DECAYED_FORMS = ("stored", "recomputed_q", "recomputed")
TC_DECAYED = "stored"


@dataclass(frozen=True)
class ChunkPrep:
    """The state-free products of every chunk of every live segment (`forest_gdn_prep`), per
    packed row and value head: w = T (beta exp(gam) k), u = T (beta v), and gam."""

    chunk: int
    dots: str
    w: torch.Tensor  # fp32 [T, HV, dk]
    u: torch.Tensor  # fp32 [T, HV, dv]
    gam: torch.Tensor  # fp32 [T, HV]


@dataclass(frozen=True)
class TcPrep:
    """The state-free products of every 64-token chunk of every live segment for the
    tensor-core walk (`forest_gdn_prep(chunk=TC_CHUNK)`), per packed row and value head, in the
    operand dtype (bf16 or fp32): w and u of the WY form, q exp(gam), k exp(gam_last - gam),
    the chunk's decayed causal scores (a row's 64 columns), and gam (fp32). Under a `decayed`
    form that remakes q exp(gam) (k exp(gam_last - gam)) where it is read, qg (kd) holds no rows
    and q_norm (k_norm, gam_last) what the remaking reads beside the conv rows."""

    chunk: int
    dots: str
    w: torch.Tensor  # [T, HV, dk]
    u: torch.Tensor  # [T, HV, dv]
    qg: torch.Tensor  # [T, HV, dk]
    kd: torch.Tensor  # [T, HV, dk]
    scores: torch.Tensor  # [T, HV, TC_CHUNK]
    gam: torch.Tensor  # fp32 [T, HV]
    walk: str = "split"  # TC_WALKS
    walk_bv: int = TC_WALK_BV
    walk_warps: int = TC_WARPS
    walk_stages: int = 2
    qblocks: torch.Tensor | None = None  # the pass's query blocks (split: the outputs' launch)
    chunk_no: torch.Tensor | None = None  # int32 [T], a chunk's number at its first row
    starts: torch.Tensor | None = None  # split: [NH, HV, dk, dv] every chunk's start state
    updates: torch.Tensor | None = None  # split: [T, HV, dv] the chunks' U = u - w S
    prep_form: str = "blocks"  # TC_PREP_FORMS: the kernel that made the products
    decayed: str = "stored"  # TC_DECAYED_FORMS; made, not stored: qg (kd) hold no rows, these do:
    q_norm: torch.Tensor | None = None  # fp32 [T, HV]: q_scale / |q| per row (l2 norm + eps)
    k_norm: torch.Tensor | None = None  # fp32 [T, HV]: 1 / |k| per row
    gam_last: torch.Tensor | None = None  # fp32 [T, HV]: at a chunk's first row, the decay k's took
    conv: torch.Tensor | None = None  # the conv rows the prep read (the "recomputed" form reads them)
    num_k_heads: int = 1


def _check_gdn_inputs(
    conv: torch.Tensor,
    b_raw: torch.Tensor,
    a_raw: torch.Tensor,
    ssm_a: torch.Tensor,
    dt: torch.Tensor,
    segs: torch.Tensor,
    hqk: int,
    hv: int,
    dk: int,
    dv: int,
) -> None:
    if conv.dim() != 2 or conv.dtype != torch.float32 or conv.shape[1] != 2 * hqk * dk + hv * dv:
        raise ValueError(
            f"conv must be fp32 [T, {2 * hqk * dk + hv * dv}] (q | k | v of the given heads), "
            f"got {conv.dtype} {tuple(conv.shape)}"
        )
    if hqk < 1 or hv % hqk:
        raise ValueError(f"value heads ({hv}) must be a multiple of query/key heads ({hqk})")
    t = conv.shape[0]
    for name, p in (("b_raw", b_raw), ("a_raw", a_raw)):
        if p.dim() != 2 or tuple(p.shape) != (t, hv) or not p.dtype.is_floating_point:
            raise ValueError(f"{name} must be a float tensor [{t}, {hv}], got {p.dtype} {tuple(p.shape)}")
    if tuple(ssm_a.shape) != (hv,) or tuple(dt.shape) != (hv,):
        raise ValueError(f"ssm_a and dt must be [{hv}], got {tuple(ssm_a.shape)} and {tuple(dt.shape)}")
    if segs.dim() != 2 or segs.shape[0] < 1:
        raise ValueError(f"segs must be [S >= 1, {SEG_FIELDS}], got {tuple(segs.shape)}")
    _check_table("segs", segs, (segs.shape[0], SEG_FIELDS), conv)


def gdn_dots_for(chunk: int) -> tuple[str, ...]:
    """The dot precisions a chunk size takes: TC_DOTS at TC_CHUNK, ieee or tf32 otherwise (chunk
    0, token by token, has no dots; it accepts those two as it always has)."""
    return TC_DOTS if chunk == TC_CHUNK else ("ieee", "tf32")


def _check_chunk(chunk: int, dots: str) -> None:
    if chunk and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be 0 or a power of two >= 16, got {chunk}")
    if dots not in GDN_DOTS:
        raise ValueError(f"dots must be one of {GDN_DOTS}, got {dots!r}")
    if chunk == TC_CHUNK and dots not in TC_DOTS:
        raise ValueError(f"chunk {TC_CHUNK} (tensor cores) takes dots in {TC_DOTS}, got {dots!r}")
    if dots not in gdn_dots_for(chunk):
        raise ValueError(f"bf16 dots need chunk {TC_CHUNK}, got chunk {chunk}")


def _block_v(dk: int, dv: int) -> int:
    bv = BLOCK_V if dv % BLOCK_V == 0 else 16  # 16 for the tiny test models' dv=16 heads
    if dk & (dk - 1) or dk < 16 or dv % bv:
        raise ValueError(f"the kernel needs dk a power of two >= 16 and dv a multiple of 16, got {dk}, {dv}")
    return bv


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def forest_gdn_prep(
    conv: torch.Tensor,
    b_raw: torch.Tensor,
    a_raw: torch.Tensor,
    ssm_a: torch.Tensor,
    dt: torch.Tensor,
    segs: torch.Tensor,
    qblocks: torch.Tensor,
    *,
    num_k_heads: int,
    num_v_heads: int,
    k_dim: int,
    v_dim: int,
    chunk: int = CHUNK,
    dots: str = "ieee",
    walk: str = "split",
    walk_bv: int | None = None,
    walk_warps: int | None = None,
    walk_stages: int | None = None,
    prep_form: str | None = None,
    prep_warps: int | None = None,
    decayed: str | None = None,
) -> ChunkPrep | TcPrep:
    """The chunked recurrence's products that need no state, for every chunk of every live
    segment of every level at once (chunks start at the segment start; one program per chunk
    and value head, all in parallel): with gam the cumulative log decay inside the chunk,
    A_ij = beta_i exp(gam_i - gam_j) k_i.k_j (j < i) and T = (I + A)^-1, the rows of
    w = T (beta exp(gam) k) and u = T (beta v). `forest_gdn(chunk=...)` then walks the chunks
    of each level with the state. Inputs as for `forest_gdn`, and the pass's query blocks
    (`engine.kernels.forest_tables` qblocks [Q, 3]: every live segment's blocks of BLOCK_M rows
    from its start; a chunk is made where a block starts one). The kernel path only.

    chunk TC_CHUNK (tensor cores) takes `walk` (TC_WALKS): "split" (default) leaves only the
    products with the state to the serial walk, which stores each chunk's start state and
    updates; the outputs of all chunks are then one parallel launch (`forest_gdn_outputs`, or
    per level inside `forest_gdn`). "fused": the walk makes the outputs too. walk_bv: value
    columns per split-walk program (a divisor of dv; None: TC_WALK_BV, 16 for the tiny test
    heads), walk_warps its warps (None: TC_WALK_WARPS), walk_stages its software-pipeline
    depth (None: TC_STAGES). The bits are the same either way on the
    interpreter (the same operands and products); on the GPU they may differ by the dots' tiling.
    prep_form (TC_PREP_FORMS; None: TC_PREP_FORM) picks the chunk-64 prep kernel and prep_warps
    its warps (None: TC_PREP_WARPS for "blocks", TC_INVERT_WARPS for "invert", for
    "invert_split" TC_INVERT_SPLIT_WARPS[0], its first kernel's); "blocks" and "invert" agree
    to the operands' rounding, not bitwise; "invert_split" (`_invert_split`) gives "invert"'s
    bits, and "invert" runs as it while TC_INVERT_SPLIT is set. decayed (TC_DECAYED_FORMS;
    None: TC_DECAYED for the split walk, "stored" for the fused one, which takes only that):
    whether the prep stores q exp(gam) and k exp(gam_last - gam) or the split walk and the
    outputs remake them.
    """
    hqk, hv, dk, dv = num_k_heads, num_v_heads, k_dim, v_dim
    if not chunk:
        raise ValueError("forest_gdn_prep needs a chunk size (a power of two >= 16)")
    _check_chunk(chunk, dots)
    _check_gdn_inputs(conv, b_raw, a_raw, ssm_a, dt, segs, hqk, hv, dk, dv)
    t = conv.shape[0]
    if chunk % BLOCK_M:
        raise ValueError(f"chunk must be a multiple of the query block ({BLOCK_M}), got {chunk}")
    _check_table("qblocks", qblocks, (qblocks.shape[0], QBLOCK_FIELDS), conv)
    if segs.device.type == "cpu":
        records = _check_segments(segs, t)
        for i, (slot, local, live) in enumerate(qblocks.tolist()):
            if live and (not 0 <= slot < len(records) or not records[slot][SEG_LIVE] or local % BLOCK_M):
                raise ValueError(
                    f"live query block {i} (slot {slot}, local {local}) is not a block of a live slot"
                )
    if chunk == TC_CHUNK:
        if walk_bv is None:
            walk_bv = TC_WALK_BV if dv % TC_WALK_BV == 0 else 16
        if walk not in TC_WALKS or walk_bv < 16 or walk_bv & (walk_bv - 1) or dv % walk_bv:
            raise ValueError(f"walk must be one of {TC_WALKS} and walk_bv a power of two >= 16 dividing {dv}")
        if walk_warps is None:
            walk_warps = TC_WALK_WARPS[dots]
        if walk_stages is None:
            walk_stages = TC_STAGES[dots]
        if walk_warps not in (1, 2, 4, 8) or walk_stages not in (1, 2, 3, 4):
            raise ValueError(
                f"walk_warps must be 1, 2, 4 or 8 and walk_stages 1 to 4, got {walk_warps}, {walk_stages}"
            )
        prep_form = TC_PREP_FORM if prep_form is None else prep_form
        if prep_form not in TC_PREP_FORMS:
            raise ValueError(f"prep_form must be one of {TC_PREP_FORMS}, got {prep_form!r}")
        if prep_form == "invert" and TC_INVERT_SPLIT and conv.shape[0] >= TC_INVERT_SPLIT_MIN_ROWS:
            prep_form = "invert_split"
        if prep_warps is None:
            prep_warps = {"blocks": TC_PREP_WARPS, "invert": TC_INVERT_WARPS}.get(
                prep_form, TC_INVERT_SPLIT_WARPS[0]
            )
        if prep_warps not in (4, 8):
            raise ValueError(f"prep_warps must be 4 or 8, got {prep_warps}")
        if decayed is None:
            decayed = TC_DECAYED if walk == "split" else "stored"
        if decayed not in TC_DECAYED_FORMS or (walk == "fused" and decayed != "stored"):
            raise ValueError(
                f"decayed must be one of {TC_DECAYED_FORMS} ('stored' for the fused walk), got {decayed!r}"
            )
        return _tc_prep(
            conv, b_raw, a_raw, ssm_a, dt, segs, qblocks, hqk, hv, dk, dv, dots, walk, walk_bv,
            (walk_warps, walk_stages), (prep_form, prep_warps), decayed,
        )  # fmt: skip
    bv = _block_v(dk, dv)
    prep = ChunkPrep(
        chunk=chunk,
        dots=dots,
        w=torch.empty(t, hv, dk, dtype=torch.float32, device=conv.device),
        u=torch.empty(t, hv, dv, dtype=torch.float32, device=conv.device),
        gam=torch.empty(t, hv, dtype=torch.float32, device=conv.device),
    )
    if t == 0:
        return prep
    conv, b_raw, a_raw = _unit_stride(conv), _unit_stride(b_raw), _unit_stride(a_raw)
    if qblocks.shape[0] == 0:
        return prep
    _gdn_prep[(qblocks.shape[0], hv)](
        conv, b_raw, a_raw, ssm_a.contiguous(), dt.contiguous(), segs, qblocks, prep.w, prep.u, prep.gam,
        conv.stride(0), b_raw.stride(0), a_raw.stride(0), L2NORM_EPS,
        HQK=hqk, HV=hv, DK=dk, DV=dv, BV=bv, BC=chunk, LOG2_BC=chunk.bit_length() - 1, DOTS=dots,
        num_warps=CHUNK_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return prep


def _tc_prep(
    conv: torch.Tensor,
    b_raw: torch.Tensor,
    a_raw: torch.Tensor,
    ssm_a: torch.Tensor,
    dt: torch.Tensor,
    segs: torch.Tensor,
    qblocks: torch.Tensor,
    hqk: int,
    hv: int,
    dk: int,
    dv: int,
    dots: str,
    walk: str,
    walk_bv: int,
    walk_config: tuple[int, int],
    prep_config: tuple[str, int],
    decayed: str,
) -> TcPrep:
    _block_v(dk, dv)
    t, dev = conv.shape[0], conv.device
    op = torch.bfloat16 if dots == "bf16" else torch.float32
    split = walk == "split"
    # chunks: sum over segments of ceil(length / 64) <= T // 64 + S (the segments' rows are
    # disjoint), and at most one per query block - fixed by the tables' sizes
    nh = min(qblocks.shape[0], t // TC_CHUNK + segs.shape[0]) if split else 0
    store_q, store_k = decayed == "stored", decayed in ("stored", "recomputed_q")
    conv, b_raw, a_raw = _unit_stride(conv), _unit_stride(b_raw), _unit_stride(a_raw)
    prep = TcPrep(
        chunk=TC_CHUNK,
        dots=dots,
        w=torch.empty(t, hv, dk, dtype=op, device=dev),
        u=torch.empty(t, hv, dv, dtype=op, device=dev),
        qg=torch.empty(t if store_q else 0, hv, dk, dtype=op, device=dev),
        kd=torch.empty(t if store_k else 0, hv, dk, dtype=op, device=dev),
        scores=torch.empty(t, hv, TC_CHUNK, dtype=op, device=dev),
        gam=torch.empty(t, hv, dtype=torch.float32, device=dev),
        walk=walk,
        walk_bv=walk_bv,
        walk_warps=walk_config[0],
        walk_stages=walk_config[1],
        qblocks=qblocks,
        chunk_no=torch.empty(t, dtype=torch.int32, device=dev),
        starts=torch.empty(nh, hv, dk, dv, dtype=op, device=dev),
        updates=torch.empty(t if split else 0, hv, dv, dtype=op, device=dev),
        prep_form=prep_config[0],
        decayed=decayed,
        q_norm=torch.empty(0 if store_q else t, hv, dtype=torch.float32, device=dev),
        k_norm=torch.empty(0 if store_k else t, hv, dtype=torch.float32, device=dev),
        gam_last=torch.empty(0 if store_k else t, hv, dtype=torch.float32, device=dev),
        conv=conv,
        num_k_heads=hqk,
    )
    if t == 0 or qblocks.shape[0] == 0:
        return prep
    # blocks: grid (query block, value head); invert: (value head, query block), so that the
    # value heads of one chunk (and the three of one key head) run side by side
    form, warps = prep_config
    if form == "blocks":
        launch, extra = _gdn_tc_prep[(qblocks.shape[0], hv)], {}
    elif conv.is_cuda and not invert_compiles_for(dk, dv):
        raise ValueError(
            f"prep_form {form!r} runs compiled only for head sizes that are multiples of "
            f"{INVERT_HEAD_MULTIPLE} (got dk {dk}, dv {dv}): see INVERT_HEAD_MULTIPLE"
        )
    elif qblocks.shape[0] > 65535:  # the grid's second axis (CUDA's limit); ~1M packed rows
        raise ValueError(f"prep_form {form!r} takes at most 65535 query blocks, got {qblocks.shape[0]}")
    elif form == "invert_split":
        _invert_split(
            prep, conv, b_raw, a_raw, ssm_a, dt, segs, qblocks, (hqk, hv, dk, dv), (store_q, store_k), warps
        )
        return prep
    else:  # w and u in column blocks of 64 (of 16 for the tiny test heads; dv is a multiple of 16)
        launch, extra = _gdn_tc_invert[(hv, qblocks.shape[0])], dict(BW=64 if dk % 64 == dv % 64 == 0 else 16)
    launch(
        conv, b_raw, a_raw, ssm_a.contiguous(), dt.contiguous(), segs, qblocks,
        prep.w, prep.u, prep.qg if store_q else prep.w, prep.kd if store_k else prep.w, prep.scores, prep.gam,
        prep.chunk_no, prep.gam if store_q else prep.q_norm, prep.gam if store_k else prep.k_norm,
        prep.gam if store_k else prep.gam_last, int(store_q), int(store_k),
        conv.stride(0), b_raw.stride(0), a_raw.stride(0), dk**-0.5, L2NORM_EPS,
        HQK=hqk, HV=hv, DK=dk, DV=dv, BF16=dots == "bf16", **extra,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return prep


def _invert_split(
    prep: TcPrep,
    conv: torch.Tensor,
    b_raw: torch.Tensor,
    a_raw: torch.Tensor,
    ssm_a: torch.Tensor,
    dt: torch.Tensor,
    segs: torch.Tensor,
    qblocks: torch.Tensor,
    heads: tuple[int, int, int, int],
    stores: tuple[bool, bool],
    warps: int,
) -> None:
    """The "invert_split" prep form: `_forest_gdn_tc_invert_kernel`'s products in three launches
    over the same grid (value head, query block), with the same bits. The fused kernel is a
    chain of ~14 dependent 64 x 64 products whose program holds everything at once - in its
    sm_90 build at the 27B heads and 4 warps, bf16: 253 registers, 32 KB of shared memory;
    tf32: 255 registers, 32 B of spills, 64 KB - so 2 programs (8 warps) fit an SM (65,536
    registers, ~228 KB), too few to hide each product's latency. Split where the live values
    are fewest, each kernel holds only its part (the same sm_90 builds, 2026-12-04, bf16 / tf32):
    scores (q, k, the scores and A; A stored before q is loaded, so k k^T is dead by then):
    149 / 242 registers, 32 / 64 KB: 3 / 2 programs an SM; inverse (A's parts loaded where
    each level uses them, d, T; ten tf32 products): 152 / 161 registers, 48 KB: 3 / 3; w and u
    (T and one 64-column block of k or v): 86 / 106 registers, 16 / 32 KB: 5 / 4; none spills.
    The workspaces - A (fp32 [T, HV, 64]), T (the operand dtype [T, HV, 64]) and k's l2 scale
    (fp32 [T, HV]) - are allocated here from the call's shapes alone (CUDA graphs capture the
    launches): 150 MB at 8,192 rows and the 27B heads in bf16, each written once, read once.
    Warps (`TC_INVERT_SPLIT_WARPS`, all 4): the scores kernel at the fused kernel's (`warps`),
    since its row sums and the decay's cumsum must keep the fused kernel's layouts (the same
    at 4 in the two builds' TTGIR); the other two at 4 too, one warp group per 64-row wgmma as
    the fused kernel's products (8 warps split a product's columns over two groups: another
    instruction shape, and the inverse then needs 134 registers at 8 warps, 1 program an SM).
    The w, u kernel at 8 (60 registers: 4 programs, 32 warps an SM, against 5 x 4 at 4) is
    the one open candidate; bench_gdn's "split bf16 inv3 wu8" times it and checks its bits."""
    hqk, hv, dk, dv = heads
    t, dev = conv.shape[0], conv.device
    store_q, store_k = stores
    bf16 = prep.dots == "bf16"
    am = torch.empty(t, hv, TC_CHUNK, dtype=torch.float32, device=dev)
    tm = torch.empty(t, hv, TC_CHUNK, dtype=prep.w.dtype, device=dev)
    kn = torch.empty(t, hv, dtype=torch.float32, device=dev)
    grid = (hv, qblocks.shape[0])
    _, w_inverse, w_wu = TC_INVERT_SPLIT_WARPS
    _gdn_tc_invert_scores[grid](
        conv, b_raw, a_raw, ssm_a.contiguous(), dt.contiguous(), segs, qblocks,
        prep.qg if store_q else prep.w, prep.kd if store_k else prep.w, prep.scores, prep.gam,
        prep.chunk_no, prep.gam if store_q else prep.q_norm, prep.gam if store_k else prep.k_norm,
        prep.gam if store_k else prep.gam_last, am, kn, int(store_q), int(store_k),
        conv.stride(0), b_raw.stride(0), a_raw.stride(0), dk**-0.5, L2NORM_EPS,
        HQK=hqk, HV=hv, DK=dk, DV=dv, BF16=bf16, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    _gdn_tc_invert_inverse[grid](segs, qblocks, am, tm, HV=hv, num_warps=w_inverse, enable_fp_fusion=False)
    _gdn_tc_invert_wu[grid](
        conv, b_raw, segs, qblocks, prep.w, prep.u, prep.gam, kn, tm, conv.stride(0), b_raw.stride(0),
        HQK=hqk, HV=hv, DK=dk, DV=dv, BF16=bf16, BW=64 if dk % 64 == dv % 64 == 0 else 16,
        num_warps=w_wu, enable_fp_fusion=False,
    )  # fmt: skip


def forest_gdn(
    conv: torch.Tensor,
    b_raw: torch.Tensor,
    a_raw: torch.Tensor,
    ssm_a: torch.Tensor,
    dt: torch.Tensor,
    base: torch.Tensor,
    segs: torch.Tensor,
    level: int,
    layer_off: int,
    out: torch.Tensor,
    *,
    num_k_heads: int,
    num_v_heads: int,
    k_dim: int,
    v_dim: int,
    chunk: int = 0,
    dots: str = "ieee",
    prep: ChunkPrep | TcPrep | None = None,
    outputs: bool = True,
    backend: Backend = "triton",
) -> None:
    """The delta-rule recurrence of one level's segments; writes their rows of `out` and final states.

    conv fp32 [T, 2*HQK*dk + HV*dv] (q | k | v after conv + SiLU); b_raw, a_raw [T, HV] (the
    beta and alpha projections); ssm_a, dt [HV]; out fp32 [T, HV, dv], written only at the rows
    of live segments with segs[:, SEG_LEVEL] == level. A segment starts from the [HV, dk, dv]
    block at base + state_in + layer_off (has_state_in) or zeros, and leaves its final state at
    base + state_out + layer_off (layer_off = j * HV * dk * dv for GDN layer j).

    chunk 0: token by token, exactly the decode step's arithmetic. chunk C (a power of two >= 16):
    the chunked form, C tokens per step in matrix products of `dots` precision (GDN_DOTS), from
    `prep` (`forest_gdn_prep` of the same inputs, chunk and dots, made once for all levels): per chunk
    U = u - w S, outputs exp(gam_i) S^T q_i + sum_{j<=i} exp(gam_i - gam_j) (q_i.k_j) U_j, and
    the state leaves as exp(gam_C) S + sum_j exp(gam_C - gam_j) k_j U_j^T: the same recurrence,
    summed in another order (equal to rounding, not bitwise), with no token-to-token dependency
    inside a chunk. Either way a segment's bits depend on its own tokens and initial state alone.
    The torch reference (backend "torch") is token by token whatever chunk is.

    A split chunk-64 prep (`forest_gdn_prep(walk="split")`): the walk stores the chunks' start
    states and updates, and the level's outputs follow in a parallel launch - unless outputs is
    False, when the caller makes every level's outputs in one launch after the last level with
    `forest_gdn_outputs`. outputs is moot for every other form (they write their outputs as they go).
    """
    hqk, hv, dk, dv = num_k_heads, num_v_heads, k_dim, v_dim
    _check_chunk(chunk, dots)
    _check_gdn_inputs(conv, b_raw, a_raw, ssm_a, dt, segs, hqk, hv, dk, dv)
    t = conv.shape[0]
    if out.dtype != torch.float32 or tuple(out.shape) != (t, hv, dv) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous fp32 [{t}, {hv}, {dv}], got {out.dtype} {tuple(out.shape)}")
    _check_base(base, conv)
    if level < 0 or layer_off < 0:
        raise ValueError(f"level and layer_off must be >= 0, got {level} and {layer_off}")
    reference = not use_triton(backend, conv)
    if segs.device.type == "cpu":
        for i, r in enumerate(_check_segments(segs, t, level=level)):
            if reference and r[SEG_LIVE] and r[SEG_LEVEL] == level:
                _check_block("state_out", i, r[SEG_STATE_OUT] + layer_off, hv * dk * dv, base)
                if r[SEG_HAS_STATE_IN]:
                    _check_block("state_in", i, r[SEG_STATE_IN] + layer_off, hv * dk * dv, base)
    if reference:
        forest_gdn_reference(
            conv, b_raw, a_raw, ssm_a, dt, base, segs, level, layer_off, out, hqk, hv, dk, dv
        )
        return
    bv = _block_v(dk, dv)
    if chunk and prep is None:
        raise ValueError("the chunked form reads its chunks' products: pass prep=forest_gdn_prep(...)")
    if chunk == TC_CHUNK:
        if not isinstance(prep, TcPrep) or prep.dots != dots or prep.w.shape != (t, hv, dk):
            raise ValueError(
                f"prep is for chunk {prep.chunk}, dots {prep.dots!r}, {prep.w.shape[0]} rows; "
                f"this call has chunk {chunk}, dots {dots!r}, {t} rows"
            )
        if prep.walk == "split":
            recompute = prep.decayed == "recomputed"  # k exp(gam_last - gam) made by the walk
            _gdn_tc_walk[(segs.shape[0], hv, dv // prep.walk_bv)](
                base, segs, prep.w, prep.u, prep.w if recompute else prep.kd, prep.gam, prep.chunk_no,
                prep.starts, prep.updates, level, layer_off, prep.starts.shape[0],
                prep.conv, *((prep.k_norm, prep.gam_last) if recompute else (prep.gam, prep.gam)),
                prep.conv.stride(0),
                HQK=hqk, HV=hv, DK=dk, DV=dv, BV=prep.walk_bv, BF16=dots == "bf16", RECOMPUTE=recompute,
                num_warps=prep.walk_warps, num_stages=prep.walk_stages, enable_fp_fusion=False,
            )  # fmt: skip
            if outputs:
                _tc_outputs(prep, segs, out, level)
            return
        _gdn_tc[(segs.shape[0], hv, dv // bv)](
            base, segs, out, prep.w, prep.u, prep.qg, prep.kd, prep.scores, prep.gam, level, layer_off,
            HV=hv, DK=dk, DV=dv, BV=bv, BF16=dots == "bf16",
            num_warps=TC_WARPS, num_stages=TC_STAGES[dots], enable_fp_fusion=False,
        )  # fmt: skip
        return
    if prep is not None:
        if (prep.chunk, prep.dots) != (chunk, dots) or prep.w.shape != (t, hv, dk):
            raise ValueError(
                f"prep is for chunk {prep.chunk}, dots {prep.dots!r}, {prep.w.shape[0]} rows; "
                f"this call has chunk {chunk}, dots {dots!r}, {t} rows"
            )
        w, u, gam = prep.w, prep.u, prep.gam
    else:
        w = u = gam = out  # not read by the token-by-token kernel
    conv, b_raw, a_raw = _unit_stride(conv), _unit_stride(b_raw), _unit_stride(a_raw)
    _gdn[(segs.shape[0], hv, dv // bv)](
        conv, b_raw, a_raw, ssm_a.contiguous(), dt.contiguous(), base, segs, out, w, u, gam,
        level, layer_off, conv.stride(0), b_raw.stride(0), a_raw.stride(0), dk**-0.5, L2NORM_EPS,
        HQK=hqk, HV=hv, DK=dk, DV=dv, BV=bv, BC=chunk, DOTS=dots,
        num_warps=CHUNK_WARPS if chunk else NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip


def _tc_outputs(
    prep: TcPrep, segs: torch.Tensor, out: torch.Tensor, level: int, rows: torch.Tensor | None = None
) -> None:
    assert prep.qblocks is not None and prep.starts is not None and prep.conv is not None
    t, hv, dk, dv = *prep.w.shape, out.shape[2]
    if t == 0:
        return
    num_q = prep.qblocks.shape[0]
    if num_q == 0:  # no programs to make outputs, or to write the padding rows' zeros
        if rows is not None:
            out.zero_()
        return
    bv = TC_OUT_BV if dv % TC_OUT_BV == 0 else 16
    recompute = prep.decayed != "stored"  # q exp(gam) made by the outputs
    _gdn_tc_out[(num_q, hv, dv // bv)](
        segs, prep.qblocks, out, prep.w if recompute else prep.qg, prep.scores, prep.chunk_no, prep.starts,
        prep.updates, level, prep.starts.shape[0],
        prep.conv, prep.q_norm if recompute else prep.gam, prep.gam, segs if rows is None else rows,
        prep.conv.stride(0), t, num_q,
        HQK=prep.num_k_heads, HV=hv, DK=dk, DV=dv, BV=bv, BF16=prep.dots == "bf16", RECOMPUTE=recompute,
        PAD_ZEROS=rows is not None, BR=BLOCK_M,
        num_warps=TC_WARPS, enable_fp_fusion=False,
    )  # fmt: skip


def writes_padding_zeros(prep: ChunkPrep | TcPrep | None) -> bool:
    """Whether `forest_gdn_outputs(prep, ..., rows=)` writes every row of `out` (the live ones'
    outputs, the padding ones' zeros), so the caller may hand it an uninitialised `out`: a split
    chunk-64 prep. Every other form writes only the live rows, and `out` must start zeroed."""
    return isinstance(prep, TcPrep) and prep.walk == "split"


def forest_gdn_outputs(
    prep: ChunkPrep | TcPrep | None, segs: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """The outputs of every level's chunks in one parallel launch, after the last level's
    `forest_gdn(..., outputs=False)` with a split chunk-64 prep (each chunk's start state and
    updates are stored by then); does nothing for any other prep (their walks wrote the outputs).

    rows: the pass's row table [T, ROW_FIELDS]; given (with a split prep), the launch also writes
    zeros to the padding rows (live 0), so `out` may come uninitialised (`torch.empty`): a memset
    of out (200 MB at 8,192 rows and the 27B heads) saved. Padding rows are defined as zeros, as
    the conv and attention leave theirs, though only row-local ops read them downstream."""
    if not writes_padding_zeros(prep):
        return
    assert isinstance(prep, TcPrep) and prep.updates is not None
    want = (prep.w.shape[0], prep.w.shape[1], prep.updates.shape[2])
    if out.dtype != torch.float32 or tuple(out.shape) != want or not out.is_contiguous():
        raise ValueError(f"out must be contiguous fp32 {list(want)}, got {out.dtype} {tuple(out.shape)}")
    _check_table("segs", segs, (segs.shape[0], SEG_FIELDS), out)
    if rows is not None:
        _check_table("rows", rows, (want[0], ROW_FIELDS), out)
    _tc_outputs(prep, segs, out, -1, rows)


# ------------------------------------------------------------------------ torch references
def _block(base: torch.Tensor, off: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 block at base + off viewed as `shape` (a view: writes land in place)."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return torch.as_strided(base, shape, tuple(reversed(strides)), base.storage_offset() + off)


def _sources(
    x: torch.Tensor, base: torch.Tensor, srcs: list[list[int]], layer_off: int, c: int
) -> torch.Tensor:
    """The W - 1 inputs before a segment, as a tail [C, W-1] (oldest first)."""
    w1 = len(srcs)
    tail = torch.zeros(c, w1, dtype=torch.float32, device=x.device)
    for k, (kind, value) in enumerate(srcs):
        if kind == CONV_ROW:
            tail[:, k] = x[value].float()
        elif kind == CONV_TAIL:
            tail[:, k] = torch.as_strided(base, (c,), (w1,), base.storage_offset() + value + layer_off)
    return tail


def forest_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    base: torch.Tensor,
    rows: torch.Tensor,
    segs: torch.Tensor,
    conv_src: torch.Tensor,
    layer_off: int,
) -> torch.Tensor:
    """Segment by segment through `engine.run.reference.causal_conv` (fp32): the kernel's oracle.

    Every source is read before any final tail is written.
    """
    t, c = x.shape
    w = weight.shape[1]
    y = torch.zeros(t, c, dtype=torch.float32, device=x.device)
    finals = []
    for r, srcs in zip(segs.tolist(), conv_src.tolist(), strict=True):
        if not r[SEG_LIVE]:
            continue
        lo, n = r[SEG_TOK_LO], r[SEG_LENGTH]
        tail = _sources(x, base, srcs, layer_off, c)
        if n:
            pre, tail = causal_conv(x[lo : lo + n].float(), tail, weight.float())
            y[lo : lo + n] = F.silu(pre)
        finals.append((r[SEG_CONV_OUT] + layer_off, tail))
    for off, tail in finals:
        _block(base, off, (c, w - 1)).copy_(tail)
    return y


def forest_gdn_reference(
    conv: torch.Tensor,
    b_raw: torch.Tensor,
    a_raw: torch.Tensor,
    ssm_a: torch.Tensor,
    dt: torch.Tensor,
    base: torch.Tensor,
    segs: torch.Tensor,
    level: int,
    layer_off: int,
    out: torch.Tensor,
    hqk: int,
    hv: int,
    dk: int,
    dv: int,
) -> None:
    """Segment by segment through `engine.run.reference.gated_delta_rule` (fp32): the kernel's oracle.

    Every initial state is read before any final state is written.
    """
    group = hv // hqk
    finals = []
    for r in segs.tolist():
        if not r[SEG_LIVE] or r[SEG_LEVEL] != level:
            continue
        lo, n = r[SEG_TOK_LO], r[SEG_LENGTH]
        state = (
            _block(base, r[SEG_STATE_IN] + layer_off, (hv, dk, dv)).clone()
            if r[SEG_HAS_STATE_IN]
            else torch.zeros(hv, dk, dv, dtype=torch.float32, device=base.device)
        )
        if n:
            q, k, v = torch.split(conv[lo : lo + n].float(), [hqk * dk, hqk * dk, hv * dv], dim=-1)
            q = (l2_normalize(q.reshape(n, hqk, dk)) * dk**-0.5).repeat_interleave(group, dim=1)
            k = l2_normalize(k.reshape(n, hqk, dk)).repeat_interleave(group, dim=1)
            beta = torch.sigmoid(b_raw[lo : lo + n].float())
            g = ssm_a.float() * F.softplus(a_raw[lo : lo + n].float() + dt.float())
            out[lo : lo + n], state = gated_delta_rule(q, k, v.reshape(n, hv, dv), g, beta, state)
        finals.append((r[SEG_STATE_OUT] + layer_off, state))
    for off, state in finals:
        _block(base, off, (hv, dk, dv)).copy_(state)
