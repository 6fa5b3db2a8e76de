"""One-query-per-row gated attention for decode steps, over K/V pieces read where they lie.

Two kernels per attention layer (`engine.run.decoder`):

- `attention_prep`: program (row, head) RMS-normalises (q_norm / k_norm, per head) and applies
  partial NeoX RoPE to the row's query head, or - for the extra programs, one per KV head - to
  its key, and stores key and value at position thought_len of the row's own thought buffer.
  cos/sin per row come from the host (`engine.run.rope.rope_rows`, fp64 angles).
- `decode_attention`: program (row, KV head) takes the G = heads / kv_heads query heads that
  read that KV head and walks the row's pieces in their fixed order (ancestors oldest first,
  then the own thought buffer, causal by construction: it holds only tokens up to this one).
  Each piece is reduced on its own in blocks of BLOCK_L keys (online softmax), then folded
  into a running (max, sum, output), exactly the cascade of `engine.run.executor._cascade`; the
  output is multiplied by sigmoid(gate).

Pieces are described by the row's piece table (`engine.kernels.decode_rows`): offsets from a
`base` fp32 tensor, so the shared system and evidence K/V are read in place by every row that
descends from them. One program per (row, KV head) with a config fixed by the head sizes: a
row's bits never depend on what else is in the batch.

Split over the prefix (`SPLITS` > 1, the default): one (row, KV head) has only 4 programs at
27B, which walk thousands of keys one block after another - latency, not bandwidth. The keys
are cut into chunks of BLOCK_L from each piece's start, numbered piece after piece; a row uses
U = min(SPLITS, max(1, ceil(chunks / SPLIT_MIN_CHUNKS))) of its SPLITS programs - a short row
few (many near-empty programs cost more than they save when 64 rows share the GPU), a long
one all - and program (row, KV head, s < U) reduces chunks s, s + U, s + 2 U, ... in that
order (each one a piece of the cascade, folded in); a second launch folds the partials in the
order s = 0, 1, ... and applies the gate. Chunking, U and both fold orders depend on the row's
own lengths and the constants alone, so a row's bits still never depend on the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from engine.kernels._triton import Backend, helper, kernel, next_pow2, use_triton
from engine.kernels.decode_rows import (
    HEAD_ROWS,
    K_OFF,
    LENGTH,
    LIVE,
    PIECE_FIELDS,
    ROW_FIELDS,
    THOUGHT_LEN,
    V_OFF,
)
from engine.run.reference import apply_partial_rope, fold_attention_piece, rms_norm

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

NUM_WARPS = 4
SPLITS = 16  # programs per (row, KV head) over the prefix; a constant: it decides the bits
# a split program's blocks are far apart: no software pipeline. Warps per split program by dot
# precision, from `ops/bench/bench_decode_attention.py` on the H200 (2026-12-01, 27B heads, us
# per layer at 1 / 64 rows of 283 tokens and 1 row of 8,219): fp32 FMA dots need 8 warps (110
# registers, no spills; 4 warps spill: 134 / 1,792 / 2,370), 23.8 / 269 / 232; bf16
# tensor-core dots run best on 4, 14.7 / 87.0 / 71.8 (8 warps: 14.8 / 132 / 74.9; tf32 not
# measured, given bf16's). A constant S = 4 or 8 was faster at 64 short rows (65 / 74 us) but
# 3.2x / 1.7x slower after long evidence: hence a row's U of S (SPLIT_MIN_CHUNKS).
SPLIT_STAGES = 1
SPLIT_WARPS = {"ieee": 8, "tf32": 4, "bf16": 4}
SPLIT_MIN_CHUNKS = 2  # chunks of BLOCK_L keys per used split program, at least (module docstring)


BLOCK_L_WIDE = 32  # keys per block at head_dim >= 256 (64 below): a [BLOCK_L, head_dim] fp32 tile


class PrepInputs(NamedTuple):
    """What an attention prep reads for one layer, named once for both preps (decode rows here,
    packed forest rows in `engine.kernels.forest_attention`) and their oracle.

    qg [N, nh * 2 * hd] (per head [q | gate]), k and v [N, nkv * hd] (any float dtype, unit column
    stride): each row's projections; q_norm, k_norm [hd]: the layer's per-head RMS weights; rope
    fp32 [N, 2, rope_dims]: each row's cos and sin.
    """

    qg: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    rope: torch.Tensor


class AttentionHeads(NamedTuple):
    """A full-attention layer's head geometry and norm epsilon (the model's, fixed at load)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


# Piece offsets (k_off, v_off) are multiples of this many elements: every K/V view the engine
# makes is whole [.., head_dim] rows of a torch allocation (>= 64-byte aligned, as the body's
# `base`), and the kernels' fp32 K/V tiles are read at those offsets. Unannounced, the compiler
# knows nothing of a loaded offset's alignment and copies those tiles 4 bytes at a time (sm_90
# build: every K/V `cp.async` of the 16-row, split and ancestor paths was 4-byte, against 16
# for the bf16 shadow's); at 4 they go 16 bytes at a time. The same values are loaded either
# way. 1 is the former build (no hint), for the bench's old-vs-new rows. Checked on the host
# for CPU tables (the interpreter, where a wrong hint would go unnoticed); on CUDA a violated
# one faults (misaligned address) rather than reading wrong data.
PIECE_ALIGN = 4


def _block_l(head_dim: int) -> int:
    """Keys per block: a [BLOCK_L, head_dim] fp32 tile of K and of V per step."""
    return BLOCK_L_WIDE if head_dim >= 256 else 64


def _norm_rope(src, w_ptr, rope_ptr, eps, HD: tl.constexpr, RD: tl.constexpr):
    """One head vector at src: RMS-normalised (weights at w_ptr), then partial NeoX RoPE with the
    row's cos at rope_ptr and sin at rope_ptr + RD (the first RD dims rotate, halves paired)."""
    offs = tl.arange(0, HD)
    half = RD // 2
    in_rope = offs < RD
    partner = tl.where(offs < half, offs + half, offs - half)
    partner = tl.where(in_rope, partner, offs)
    sign = tl.where(offs < half, -1.0, 1.0)
    cos = tl.load(rope_ptr + offs, mask=in_rope, other=1.0)
    sin = tl.load(rope_ptr + RD + offs, mask=in_rope, other=0.0)
    x = tl.load(src + offs).to(tl.float32)
    inv = tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, axis=0), HD * 1.0) + eps)
    y = (x * inv) * tl.load(w_ptr + offs).to(tl.float32)
    xp = tl.load(src + partner).to(tl.float32)
    yp = (xp * inv) * tl.load(w_ptr + partner).to(tl.float32)
    return tl.where(in_rope, y * cos + (sign * yp) * sin, y)


def _piece_offsets(rec, ALIGN: tl.constexpr):
    """A piece record's K and V offsets, declared multiples of ALIGN elements (`PIECE_ALIGN`)."""
    k_off = tl.load(rec)
    v_off = tl.load(rec + 1)
    if ALIGN > 1:
        k_off = tl.multiple_of(k_off, ALIGN)
        v_off = tl.multiple_of(v_off, ALIGN)
    return k_off, v_off


def _prep_kernel(
    qg_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, rope_ptr, base_ptr, rows_ptr, pieces_ptr, q_out_ptr,
    stride_qg, stride_k, stride_v, eps,
    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr, P: tl.constexpr,
    PACKED: tl.constexpr, ALIGN: tl.constexpr, QBF16: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (row, head j) over `_prep_head`; the two row layouts differ only in where a row's
    piece table and own position are. A decode row (PACKED 0) has a table of its own and writes at
    its thought length; a packed forest row (PACKED 1) uses its segment's table and writes at its
    local index (a padding row reads slot 0's table and writes nothing)."""
    row = tl.program_id(0)
    j = tl.program_id(1)
    if PACKED:  # row record (engine.kernels.forest_tables): segment slot, local index, live, token
        live = tl.load(rows_ptr + row * 4 + 2)
        table = tl.where(live != 0, tl.load(rows_ptr + row * 4), 0)
        index = tl.load(rows_ptr + row * 4 + 1)
    else:  # row record (engine.kernels.decode_rows): token, thought_len, state_off, conv_off, live
        index = tl.load(rows_ptr + row * 5 + 1)
        live = tl.load(rows_ptr + row * 5 + 4)
        table = row
    _prep_head(
        qg_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, rope_ptr, base_ptr, pieces_ptr + table * P * 4, q_out_ptr,
        stride_qg, stride_k, stride_v, eps, row, j, index, live, NH, HD, RD, P, ALIGN, QBF16, ON_GPU,
    )  # fmt: skip


def _prep_head(
    qg_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, rope_ptr, base_ptr, row_pieces, q_out_ptr,
    stride_qg, stride_k, stride_v, eps, row, j, index, live,
    NH: tl.constexpr, HD: tl.constexpr, RD: tl.constexpr, P: tl.constexpr, ALIGN: tl.constexpr,
    QBF16: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Head j of a row (j < NH: a query head, else KV head j - NH): RMSNorm and RoPE; a query
    head goes to q_out (QBF16: rounded to bf16 as `_bf16_operand` rounds it, into a bf16 q_out),
    a KV head's k and v to position `index` of the row's own piece (the last of its P piece
    records at row_pieces) when the row is live. The decode prep and the forest prep differ
    only in where a row's pieces and own position come from."""
    offs = tl.arange(0, HD)
    is_q = j < NH
    if is_q:
        src = qg_ptr + row * stride_qg + j * 2 * HD  # attn_q interleaves [q_h | gate_h] per head
        w_ptr = qn_ptr
    else:
        src = k_ptr + row * stride_k + (j - NH) * HD
        w_ptr = kn_ptr
    out = _norm_rope(src, w_ptr, rope_ptr + row * 2 * RD, eps, HD, RD)
    if is_q:
        if QBF16:  # noqa: SIM108 - a constexpr branch
            q = _bf16_operand(out, ON_GPU)  # the interpreter's bf16 store truncates: store a rounded value
        else:
            q = out
        tl.store(q_out_ptr + (row * NH + j) * HD + offs, q)
    else:
        kv = j - NH
        own = row_pieces + (P - 1) * 4  # piece record: k_off, v_off, length, rows_per_head
        k_off, v_off = _piece_offsets(own, ALIGN)
        head_rows = tl.load(own + 3)
        at = (kv * head_rows + index) * HD + offs
        m = (offs * 0 + live) != 0  # block-shaped: the interpreter rejects scalar masks
        tl.store(base_ptr + k_off + at, out, mask=m)
        v = tl.load(v_ptr + row * stride_v + kv * HD + offs).to(tl.float32)
        tl.store(base_ptr + v_off + at, v, mask=m)


def _bf16_operand(x, ON_GPU: tl.constexpr):
    """x rounded to bf16 (nearest even) for a tensor-core dot. The interpreter's bf16 dot is not
    usable and its conversion truncates, so there the rounded values stay fp32 (exact: a bf16
    value is an fp32 value, and so is the product of two) and the dot runs in fp32."""
    if ON_GPU:
        out = x.to(tl.bfloat16)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    return out


def _reduce_piece(
    q, k_base, v_base, n, last, scale,
    M: tl.constexpr, HD: tl.constexpr, BL: tl.constexpr, DOTS: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Online softmax of queries q [M, HD] over one piece's n keys/values ([n, HD] at k_base,
    v_base), query row r seeing keys 0 .. last[r], in blocks of BL keys from the piece start:
    the piece's (max, sum, unnormalised output) for `fold` into the running result. DOTS: "ieee"
    (fp32 FMA dots), "tf32" or "bf16" (tensor cores; bf16 rounds q, k, the block's probabilities
    and v to bf16, accumulating in fp32)."""
    offs_d = tl.arange(0, HD)
    m_p = tl.full((M,), float("-inf"), tl.float32)
    sum_p = tl.zeros((M,), dtype=tl.float32)
    acc_p = tl.zeros((M, HD), dtype=tl.float32)
    for start in range(0, n, BL):
        offs_l = start + tl.arange(0, BL)
        lmask = offs_l < n
        kt = tl.load(k_base + offs_l[:, None] * HD + offs_d[None, :], mask=lmask[:, None], other=0.0)
        if DOTS == "bf16":
            s = tl.dot(_bf16_operand(q, ON_GPU), tl.trans(_bf16_operand(kt, ON_GPU))) * scale
        else:
            s = tl.dot(q, tl.trans(kt), input_precision=DOTS) * scale
        s = tl.where(lmask[None, :] & (offs_l[None, :] <= last[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_p, tl.max(s, axis=1))
        alpha = tl.exp(m_p - m_new)
        e = tl.exp(s - m_new[:, None])
        sum_p = sum_p * alpha + tl.sum(e, axis=1)
        vt = tl.load(v_base + offs_l[:, None] * HD + offs_d[None, :], mask=lmask[:, None], other=0.0)
        if DOTS == "bf16":
            pv = tl.dot(_bf16_operand(e, ON_GPU), _bf16_operand(vt, ON_GPU))
        else:
            pv = tl.dot(e, vt, input_precision=DOTS)
        acc_p = acc_p * alpha[:, None] + pv
        m_p = m_new
    return m_p, sum_p, acc_p


def _fold(m, total, acc, m_p, sum_p, acc_p):
    """The online softmax's merge: a partial (max m_p, sum, unnormalised output) folded into the
    running (m, total, acc) of the same query rows. Every attention kernel here folds with these
    exact operations, so a row's result depends only on its partials' order, never on the kernel."""
    m_new = tl.maximum(m, m_p)
    old_scale = tl.exp(m - m_new)
    new_scale = tl.exp(m_p - m_new)
    return m_new, total * old_scale + sum_p * new_scale, acc * old_scale[:, None] + acc_p * new_scale[:, None]


def _fold_where(has, m, total, acc, m_p, sum_p, acc_p):
    """`_fold` where `has` (a partial that saw keys), the running result unchanged elsewhere:
    for partials that may be empty (their max is -inf, which `_fold` would turn into NaN)."""
    m_new = tl.where(has, tl.maximum(m, m_p), m)
    old_scale = tl.where(has, tl.exp(m - m_new), 1.0)
    new_scale = tl.where(has, tl.exp(m_p - m_new), 0.0)
    return m_new, total * old_scale + sum_p * new_scale, acc * old_scale[:, None] + acc_p * new_scale[:, None]


def _gated(acc, total, gate):
    """A row's attention output: the folded sum normalised (rows that saw no key stay 0), times
    the gated-attention gate sigmoid(gate)."""
    safe = tl.where(total > 0, total, 1.0)
    o = acc / safe[:, None]
    return o * (1.0 / (1.0 + tl.exp(-gate)))


def _decode_row(
    q_ptr, rows_ptr, row, kvh, NH: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr
):
    """A decode row's record (thought length, live) and the G query heads [GP, HD] of KV head kvh
    (rows past G masked), as both decode attention kernels start."""
    tlen = tl.load(rows_ptr + row * 5 + 1)
    live = tl.load(rows_ptr + row * 5 + 4)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, HD)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + (row * NH + heads[:, None]) * HD + offs_d[None, :], mask=gmask[:, None], other=0.0)
    return tlen, live, offs_g, offs_d, gmask, heads, q


def _attention_kernel(
    q_ptr, qg_ptr, base_ptr, rows_ptr, pieces_ptr, out_ptr, stride_qg, scale,
    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    P: tl.constexpr, BL: tl.constexpr, DOTS: tl.constexpr, ALIGN: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    tlen, live, offs_g, offs_d, gmask, heads, q = _decode_row(q_ptr, rows_ptr, row, kvh, NH, HD, G, GP)
    m = tl.full((GP,), float("-inf"), tl.float32)
    total = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, HD), dtype=tl.float32)
    for p in tl.static_range(P):
        rec = pieces_ptr + (row * P + p) * 4  # piece record: k_off, v_off, length, rows_per_head
        k_off, v_off = _piece_offsets(rec, ALIGN)
        k_base = base_ptr + k_off
        v_base = base_ptr + v_off
        n = tl.load(rec + 2)
        head_rows = tl.load(rec + 3)
        if p == P - 1:
            n = tlen + 1  # the own thought, this step's token included
        n = tl.where(live != 0, n, 0)
        k_base += kvh * head_rows * HD
        v_base += kvh * head_rows * HD
        last = tl.full((GP,), 0, tl.int64) + n - 1  # every key of the piece (the own one ends here)
        m_p, sum_p, acc_p = _reduce_piece(q, k_base, v_base, n, last, scale, GP, HD, BL, DOTS, ON_GPU)
        # fold the piece into the running result (an empty piece changes nothing)
        m, total, acc = _fold_where(n > 0, m, total, acc, m_p, sum_p, acc_p)

    gate = tl.load(
        qg_ptr + row * stride_qg + heads[:, None] * 2 * HD + HD + offs_d[None, :],
        mask=gmask[:, None],
        other=0.0,
    )
    o = _gated(acc, total, gate)
    o = tl.where((offs_g[:, None] * 0 + offs_d[None, :] * 0 + live) != 0, o, 0.0)
    tl.store(out_ptr + (row * NH + heads[:, None]) * HD + offs_d[None, :], o, mask=gmask[:, None])


def _attention_split_kernel(
    q_ptr, base_ptr, rows_ptr, pieces_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, scale,
    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    P: tl.constexpr, BL: tl.constexpr, S: tl.constexpr, MC: tl.constexpr, DOTS: tl.constexpr,
    ALIGN: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (row, KV head, s): the chunks numbered s mod U of the row's pieces, U = the
    row's programs (see the module docstring), folded in order into one partial (max, sum,
    output) per query head; programs s >= U leave an empty partial."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    tlen, live, offs_g, offs_d, gmask, heads, q = _decode_row(q_ptr, rows_ptr, row, kvh, NH, HD, G, GP)
    m = tl.full((GP,), float("-inf"), tl.float32)
    total = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, HD), dtype=tl.float32)
    # how many of the S programs this row uses: one per MC chunks, at least 1, at most S
    total_chunks = tlen * 0
    for p in tl.static_range(P):
        n = tl.load(pieces_ptr + (row * P + p) * 4 + 2)
        if p == P - 1:
            n = tlen + 1
        total_chunks += (tl.where(live != 0, n, 0) + BL - 1) // BL
    used = tl.minimum(tl.maximum((total_chunks + MC - 1) // MC, 1), S)
    first = tlen * 0  # chunks before this piece (int64)
    for p in tl.static_range(P):
        rec = pieces_ptr + (row * P + p) * 4  # piece record: k_off, v_off, length, rows_per_head
        head_rows = tl.load(rec + 3)
        k_off, v_off = _piece_offsets(rec, ALIGN)
        k_base = base_ptr + k_off + kvh * head_rows * HD
        v_base = base_ptr + v_off + kvh * head_rows * HD
        n = tl.load(rec + 2)
        if p == P - 1:
            n = tlen + 1  # the own thought, this step's token included
        n = tl.where(live != 0, n, 0)
        chunks = (n + BL - 1) // BL
        start = tl.where(split < used, (split - first % used + used) % used, chunks)
        for j in range(start, chunks, used):
            count = tl.minimum(n - j * BL, BL)
            last = tl.full((GP,), 0, tl.int64) + count - 1
            m_p, sum_p, acc_p = _reduce_piece(
                q, k_base + j * BL * HD, v_base + j * BL * HD, count, last, scale, GP, HD, BL, DOTS, ON_GPU
            )
            m, total, acc = _fold(m, total, acc, m_p, sum_p, acc_p)
        first += chunks
    at = ((row * NKV + kvh) * S + split) * G + offs_g
    tl.store(ws_m_ptr + at, m, mask=gmask)
    tl.store(ws_l_ptr + at, total, mask=gmask)
    # an empty partial (no chunk: short rows leave most of the S programs idle) writes no output
    keep = gmask & (total > 0.0)
    tl.store(ws_acc_ptr + at[:, None] * HD + offs_d[None, :], acc, mask=keep[:, None])


def _attention_combine_kernel(
    qg_ptr, rows_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, out_ptr, stride_qg,
    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    S: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (row, KV head): the S partials folded in split order (an empty one - no chunk -
    is skipped, its output never read), normalised, times sigmoid(gate)."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    live = tl.load(rows_ptr + row * 5 + 4)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, HD)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    m = tl.full((GP,), float("-inf"), tl.float32)
    total = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, HD), dtype=tl.float32)
    for split in range(0, S):
        at = ((row * NKV + kvh) * S + split) * G + offs_g
        sum_p = tl.load(ws_l_ptr + at, mask=gmask, other=0.0)
        has = sum_p > 0.0
        m_p = tl.load(ws_m_ptr + at, mask=has, other=float("-inf"))
        acc_p = tl.load(ws_acc_ptr + at[:, None] * HD + offs_d[None, :], mask=has[:, None], other=0.0)
        m, total, acc = _fold_where(has, m, total, acc, m_p, sum_p, acc_p)
    gate = tl.load(
        qg_ptr + row * stride_qg + heads[:, None] * 2 * HD + HD + offs_d[None, :],
        mask=gmask[:, None],
        other=0.0,
    )
    o = _gated(acc, total, gate)
    o = tl.where((offs_g[:, None] * 0 + offs_d[None, :] * 0 + live) != 0, o, 0.0)
    tl.store(out_ptr + (row * NH + heads[:, None]) * HD + offs_d[None, :], o, mask=gmask[:, None])


_norm_rope = helper(_norm_rope)  # type: ignore[assignment]
_piece_offsets = helper(_piece_offsets)  # type: ignore[assignment]
_bf16_operand = helper(_bf16_operand)  # type: ignore[assignment]
_reduce_piece = helper(_reduce_piece)  # type: ignore[assignment]
_fold = helper(_fold)  # type: ignore[assignment]
_prep_head = helper(_prep_head)  # type: ignore[assignment]
_decode_row = helper(_decode_row)  # type: ignore[assignment]
_fold_where = helper(_fold_where)  # type: ignore[assignment]
_gated = helper(_gated)  # type: ignore[assignment]
_prep = kernel(_prep_kernel)
_attn = kernel(_attention_kernel)
_attn_split = kernel(_attention_split_kernel)
_attn_combine = kernel(_attention_combine_kernel)


def _check_alignment(pieces: torch.Tensor) -> None:
    """CPU tables (interpreter runs): every piece offset a multiple of PIECE_ALIGN. CUDA tables
    are not read back (a sync per layer); the compiled kernels fault on a misaligned one."""
    if PIECE_ALIGN > 1 and not pieces.is_cuda and bool((pieces[..., :2] % PIECE_ALIGN).any()):
        raise ValueError(f"piece offsets must be multiples of {PIECE_ALIGN} elements (PIECE_ALIGN)")


def _check_tables(rows: torch.Tensor, pieces: torch.Tensor, b: int) -> None:
    if rows.dtype != torch.int64 or rows.shape != (b, ROW_FIELDS) or not rows.is_contiguous():
        raise ValueError(
            f"rows must be contiguous int64 [{b}, {ROW_FIELDS}], got {rows.dtype} {tuple(rows.shape)}"
        )
    if (
        pieces.dtype != torch.int64
        or pieces.dim() != 3
        or pieces.shape[0] != b
        or pieces.shape[2] != PIECE_FIELDS
    ):
        raise ValueError(
            f"pieces must be int64 [{b}, P, {PIECE_FIELDS}], got {pieces.dtype} {tuple(pieces.shape)}"
        )
    if not pieces.is_contiguous():
        raise ValueError("pieces must be contiguous")


def attention_prep(
    x: PrepInputs,
    base: torch.Tensor,
    rows: torch.Tensor,
    pieces: torch.Tensor,
    heads: AttentionHeads,
    *,
    backend: Backend = "triton",
) -> torch.Tensor:
    """Normed, rotated queries fp32 [B, nh, hd]; stores each live row's key and value in its buffer
    (the own piece, last, of `pieces` [B, P, 4]) at position thought_len."""
    b = x.qg.shape[0]
    _check_tables(rows, pieces, b)
    check_rope(x.rope, b)
    if not use_triton(backend, x.qg):
        return attention_prep_reference(x, base, rows, pieces, heads)
    return launch_prep(x, base, rows, pieces, heads, packed=False)


def check_rope(rope: torch.Tensor, n: int) -> None:
    """rope must be fp32 [n, 2, rope_dims] (cos, sin per row)."""
    rd = rope.shape[-1]
    if rope.shape != (n, 2, rd) or rope.dtype != torch.float32:
        raise ValueError(f"rope must be fp32 [{n}, 2, rope_dims], got {rope.dtype} {tuple(rope.shape)}")


# Which heads a prep launch runs: all (queries, then keys and values), the query heads only
# (nothing is stored), or the key/value heads only (no query is made; its qg is never read).
PREP_PARTS = ("all", "queries", "keys")


def launch_prep(
    x: PrepInputs,
    base: torch.Tensor,
    rows: torch.Tensor,
    pieces: torch.Tensor,
    heads: AttentionHeads,
    *,
    packed: bool,
    part: str = "all",
    q_dtype: torch.dtype = torch.float32,
    pad_rows: int = 0,
) -> torch.Tensor:
    """Run the prep kernel over decode rows (`engine.kernels.decode_rows`) or packed forest rows
    (`engine.kernels.forest_tables`, `packed`) and return the normed, rotated queries.

    `part` (PREP_PARTS) picks the heads: "queries" is the same compiled kernel as "all" on a
    grid of the query heads only, so a query gets the bits "all" gives it; "keys" runs the key /
    value heads only, as the kernel built with NH = 0 (every program is then a KV head: the same
    instructions on the same inputs, one constant apart, so the same stored bits - tested) and
    returns an empty [n, 0, hd] query tensor. Why: the body's last layer needs every row's keys
    and values (the segments' states) but the queries of its read rows only. `pad_rows`: the
    queries are the first n rows of a buffer with that many more (uninitialized) rows, for a
    reader whose tiles may run past the last row (`forest_attention`'s FMHA tier)."""
    if part not in PREP_PARTS:
        raise ValueError(f"part must be one of {PREP_PARTS}, got {part!r}")
    _check_alignment(pieces)
    n = x.qg.shape[0] if part != "keys" else x.k.shape[0]
    nh, nkv, hd, eps = heads
    rd = x.rope.shape[-1]
    if hd & (hd - 1) or rd % 2 or rd > hd:
        raise ValueError(f"the kernel needs a power-of-two head_dim and an even rope_dims <= it: {hd}, {rd}")
    device = x.k.device if part == "keys" else x.qg.device
    if q_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"q_dtype must be float32 or bfloat16, got {q_dtype}")
    if pad_rows < 0:
        raise ValueError(f"pad_rows must be >= 0, got {pad_rows}")
    q_out = torch.empty(n + pad_rows, 0 if part == "keys" else nh, hd, dtype=q_dtype, device=device)[:n]
    if n == 0:
        return q_out
    grid_heads = {"all": nh + nkv, "queries": nh, "keys": nkv}[part]
    kernel_nh = 0 if part == "keys" else nh
    qg = x.k if part == "keys" else x.qg  # "keys": a placeholder pointer, never read
    _prep[(n, grid_heads)](
        qg, x.k, x.v, x.q_norm.contiguous(), x.k_norm.contiguous(), x.rope.contiguous(), base, rows, pieces,
        q_out, qg.stride(0), x.k.stride(0), x.v.stride(0), float(eps),
        NH=kernel_nh, NKV=nkv, HD=hd, RD=rd, P=pieces.shape[1], PACKED=packed, ALIGN=PIECE_ALIGN,
        QBF16=q_dtype == torch.bfloat16,
        num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return q_out


def decode_attention(
    q: torch.Tensor,
    qg: torch.Tensor,
    base: torch.Tensor,
    rows: torch.Tensor,
    pieces: torch.Tensor,
    *,
    num_kv_heads: int,
    splits: int | None = None,
    dots: str = "ieee",
    num_warps: int | None = None,
    backend: Backend = "triton",
) -> torch.Tensor:
    """Gated attention output fp32 [B, nh * hd] of queries q [B, nh, hd] over each row's pieces.

    The gate is the second half of each head's [q | gate] in qg [B, nh * 2 * hd]. `splits`
    (default `SPLITS`; 1: one program per row and KV head) fixes the prefix split, and with
    it the bits: a decoder keeps one value for every step and batch. `dots`: "ieee" (fp32 FMA
    products, the reference's arithmetic to rounding), or "bf16" / "tf32" tensor-core products
    (as the body's `attention_dots`: q, k, the probabilities and v rounded, fp32 accumulation).
    `num_warps`: the unsplit kernel's warps (default NUM_WARPS; the split kernels keep theirs) -
    the one-pass body's read rows (`engine.run.body`) run it with the forest kernel's warps, so
    that both reduce a row's 16-row tiles in the same layouts.
    """
    if dots not in ("ieee", "tf32", "bf16"):
        raise ValueError(f"dots must be ieee, tf32 or bf16, got {dots!r}")
    b, nh, hd = q.shape
    _check_tables(rows, pieces, b)
    if not use_triton(backend, q):
        return decode_attention_reference(q, qg, base, rows, pieces, num_kv_heads)
    _check_alignment(pieces)  # what the kernels declare (the prep checks in `launch_prep`)
    group = nh // num_kv_heads
    splits = SPLITS if splits is None else splits
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    out = torch.empty(b, nh * hd, dtype=torch.float32, device=q.device)
    gp = max(16, next_pow2(group))
    if splits > 1:
        ws_m = torch.empty(b, num_kv_heads, splits, group, dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty(b, num_kv_heads, splits, group, hd, dtype=torch.float32, device=q.device)
        _attn_split[(b, num_kv_heads, splits)](
            q.contiguous(), base, rows, pieces, ws_m, ws_l, ws_acc, hd**-0.5,
            NH=nh, NKV=num_kv_heads, HD=hd, G=group, GP=gp, P=pieces.shape[1], BL=_block_l(hd), S=splits,
            MC=SPLIT_MIN_CHUNKS, DOTS=dots, ALIGN=PIECE_ALIGN, num_warps=SPLIT_WARPS[dots],
            num_stages=SPLIT_STAGES, enable_fp_fusion=False,
        )  # fmt: skip
        _attn_combine[(b, num_kv_heads)](
            qg, rows, ws_m, ws_l, ws_acc, out, qg.stride(0),
            NH=nh, NKV=num_kv_heads, HD=hd, G=group, GP=next_pow2(group), S=splits,
            num_warps=NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
        return out
    _attn[(b, num_kv_heads)](
        q.contiguous(), qg, base, rows, pieces, out, qg.stride(0), hd**-0.5,
        NH=nh, NKV=num_kv_heads, HD=hd, G=group, GP=max(16, next_pow2(group)), P=pieces.shape[1],
        BL=_block_l(hd), DOTS=dots, ALIGN=PIECE_ALIGN, num_warps=num_warps or NUM_WARPS,
        enable_fp_fusion=False,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------ torch references
def _view(base: torch.Tensor, off: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """The fp32 block at base + off (inside base's storage) as [heads, rows, hd]; a view."""
    h, r, d = shape
    return torch.as_strided(base, shape, (r * d, d, 1), base.storage_offset() + off)


def query_row_reference(x: PrepInputs, r: int, heads: AttentionHeads) -> torch.Tensor:
    """Row r's q [nh, hd] normed and rotated by `engine.run.reference`'s ops."""
    nh, _, hd, eps = heads
    cos, sin = x.rope[r, 0:1], x.rope[r, 1:2]
    q_heads = x.qg[r].float().view(nh, 2 * hd)[:, :hd]
    return apply_partial_rope(rms_norm(q_heads, x.q_norm, eps)[None], cos, sin)[0]


def key_row_reference(x: PrepInputs, r: int, heads: AttentionHeads) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r's k [nkv, hd] normed and rotated, and v [nkv, hd], by `engine.run.reference`'s ops."""
    _, nkv, hd, eps = heads
    cos, sin = x.rope[r, 0:1], x.rope[r, 1:2]
    k = apply_partial_rope(rms_norm(x.k[r].float().view(1, nkv, hd), x.k_norm, eps), cos, sin)[0]
    return k, x.v[r].float().view(nkv, hd)


def prep_row_reference(
    x: PrepInputs, r: int, heads: AttentionHeads
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row r's q [nh, hd] and k [nkv, hd] normed and rotated, and v [nkv, hd], by
    `engine.run.reference`'s ops: the oracle of both attention preps (decode and forest)."""
    return (query_row_reference(x, r, heads), *key_row_reference(x, r, heads))


def prep_rows_reference(
    x: PrepInputs,
    base: torch.Tensor,
    heads: AttentionHeads,
    own_slot: Callable[[int], tuple[torch.Tensor, int] | None],
    part: str = "all",
) -> torch.Tensor:
    """Every row's query by `query_row_reference`; a row's key and value (`key_row_reference`)
    go to `own_slot(r)` (its own piece's record and the index in it), or nowhere for a padding
    row (None). `part` as in `launch_prep`: "queries" stores nothing, "keys" makes no query (an
    empty [rows, 0, hd] tensor)."""
    nh, _, hd, _ = heads
    n = x.k.shape[0] if part == "keys" else x.qg.shape[0]
    device = x.k.device if part == "keys" else x.qg.device
    q_out = torch.zeros(n, 0 if part == "keys" else nh, hd, dtype=torch.float32, device=device)
    for r in range(n):
        if part != "keys":
            q_out[r] = query_row_reference(x, r, heads)
        slot = own_slot(r) if part != "queries" else None
        if slot is not None:
            store_kv_reference(base, slot[0], slot[1], *key_row_reference(x, r, heads))
    return q_out


def store_kv_reference(
    base: torch.Tensor, own: torch.Tensor, index: int, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write a row's k and v [nkv, hd] at `index` of its own piece (record `own`) inside base."""
    nkv, hd = k.shape
    shape = (nkv, int(own[HEAD_ROWS]), hd)
    _view(base, int(own[K_OFF]), shape)[:, index] = k
    _view(base, int(own[V_OFF]), shape)[:, index] = v


def attend_row_reference(
    q_row: torch.Tensor,
    qg_row: torch.Tensor,
    base: torch.Tensor,
    records: torch.Tensor,
    own_keys: int,
    nkv: int,
) -> torch.Tensor:
    """One row's gated attention [nh * hd]: the cascade of `fold_attention_piece` over its pieces
    (`records`, the piece table's rows, oldest first; all of each ancestor's keys, the first
    `own_keys` of the own piece, which is last), then the sigmoid gate. Both attention
    kernels' oracle: a decode row and a forest row differ only in how many own keys they see."""
    nh, hd = q_row.shape
    group = nh // nkv
    qh = q_row.float()[:, None, :]  # [nh, 1, hd]
    m = torch.full((nh, 1, 1), float("-inf"), device=q_row.device)
    total = torch.zeros(nh, 1, 1, device=q_row.device)
    o = torch.zeros(nh, 1, hd, device=q_row.device)
    n_pieces = records.shape[0]
    for p in range(n_pieces):
        rec = records[p]
        n = own_keys if p == n_pieces - 1 else int(rec[LENGTH])
        if n == 0:
            continue
        shape = (nkv, int(rec[HEAD_ROWS]), hd)
        keys = _view(base, int(rec[K_OFF]), shape)[:, :n].repeat_interleave(group, dim=0)
        values = _view(base, int(rec[V_OFF]), shape)[:, :n].repeat_interleave(group, dim=0)
        scores = (qh @ keys.transpose(1, 2)) * hd**-0.5
        m, total, o = fold_attention_piece(m, total, o, scores, values)
    gate = qg_row.float().view(nh, 2 * hd)[:, hd:]
    return ((o / total)[:, 0] * torch.sigmoid(gate)).reshape(nh * hd)


def attention_prep_reference(
    x: PrepInputs, base: torch.Tensor, rows: torch.Tensor, pieces: torch.Tensor, heads: AttentionHeads
) -> torch.Tensor:
    """`engine.run.reference` norms and RoPE row by row (buffers inside base's storage): the oracle."""

    def own_slot(r: int) -> tuple[torch.Tensor, int] | None:
        return (pieces[r, -1], int(rows[r, THOUGHT_LEN])) if int(rows[r, LIVE]) else None

    return prep_rows_reference(x, base, heads, own_slot)


def decode_attention_reference(
    q: torch.Tensor,
    qg: torch.Tensor,
    base: torch.Tensor,
    rows: torch.Tensor,
    pieces: torch.Tensor,
    nkv: int,
) -> torch.Tensor:
    """Per row: the cascade of `engine.run.executor._cascade` over the pieces, then the sigmoid gate."""
    b, nh, hd = q.shape
    out = torch.zeros(b, nh * hd, dtype=torch.float32, device=q.device)
    for r in range(b):
        if int(rows[r, LIVE]):
            out[r] = attend_row_reference(q[r], qg[r], base, pieces[r], int(rows[r, THOUGHT_LEN]) + 1, nkv)
    return out
