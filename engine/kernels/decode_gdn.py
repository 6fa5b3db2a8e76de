"""One-token Gated DeltaNet step for B decode rows, state and conv tail updated in place.

Two kernels per layer (`engine.run.decoder`):

- `conv_step`: program (row, channel block) computes the causal conv (width 4) + SiLU of the
  row's new pre-conv input against its tail, then shifts the tail in place. A channel's tail
  lives in one program, so reading and writing it needs no synchronisation.
- `gdn_step`: program (row, value head, value block) l2-normalises the row's q and k of its key
  head, computes beta = sigmoid(b) and g = ssm_a * softplus(a + dt), and applies
  `engine.run.reference.gated_delta_rule` for one token to its state block S[:, block] in place:

      S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

Each row's state is found through the row table (`engine.kernels.decode_rows`), so rows may
sit in any slot of any bucket; a program reads only its own row, with a config fixed by the
head sizes, so a row's bits never depend on the batch. Padding rows (live = 0) write nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels._triton import Backend, cdiv, helper, kernel, use_triton
from engine.kernels.decode_rows import CONV_OFF, LIVE, ROW_FIELDS, STATE_OFF
from engine.run.reference import L2NORM_EPS

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

BLOCK_C = 128
BLOCK_V = 32
NUM_WARPS = 4
CONV_WIDTH = 4  # qwen35's ssm.conv_kernel; the step kernel is written for it
# The order the step kernels' programs are dispatched in. True (the default): block fastest, then
# head, then row - the GDN step's four 32-column blocks of one head's [128, 128] state, which share
# every 512-byte row of it, run side by side and read the state as one contiguous 64 KB stretch,
# and a row's conv tail is read front to back. False: row fastest - those four blocks run 64 x 48
# programs apart (at 64 rows), so each DRAM page of a state is opened once per block. Each program
# computes the same block with the same code either way: the same bits (test_kernel_decode.py).
# H100, 27B, 64 sequences, one process (bench_engine.py --decode-only --decode-sequences 64
# --variants tc64inv,tc64inv-stepblocks,tc64inv,tc64inv-stepblocks, 2026-12-07 session 33):
# 2,886 / 2,890 tokens/s row first against 2,966 / 2,965 block first (+2.7%).
BLOCKS_FIRST = True
SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus default: x above it returns x
# The state offsets carry no alignment hint: declared multiples of 4 (session 15), the compiler read
# the state 16 bytes at a time, which changed the step's register layout and so its reduction order;
# the step then no longer reproduced the forest kernel's bits (H200, tests/engine/kernels/
# test_kernel_forest_gdn.py::test_forest_segment_continues_like_decode_steps), for no measured speed
# (GDN step 119.5 us with and without the hint).


def _conv_step_kernel(
    x_ptr, w_ptr, base_ptr, rows_ptr, y_ptr, layer_off, C, stride_x, stride_y,
    BC: tl.constexpr, BLOCKS_FIRST: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    if BLOCKS_FIRST:
        row, block = tl.program_id(1), tl.program_id(0)
    else:
        row, block = tl.program_id(0), tl.program_id(1)
    offs_c = block * BC + tl.arange(0, BC)
    cmask = offs_c < C
    # row record (engine.kernels.decode_rows): token, thought_len, state_off, conv_off, live
    live = tl.load(rows_ptr + row * 5 + 4)
    conv_off = tl.load(rows_ptr + row * 5 + 3)
    m = cmask & ((offs_c * 0 + live) != 0)  # block-shaped: the interpreter rejects scalar & block masks
    tail = base_ptr + conv_off + layer_off + offs_c * 3
    t0 = tl.load(tail, mask=m, other=0.0)
    t1 = tl.load(tail + 1, mask=m, other=0.0)
    t2 = tl.load(tail + 2, mask=m, other=0.0)
    x = tl.load(x_ptr + row * stride_x + offs_c, mask=cmask, other=0.0).to(tl.float32)
    w0 = tl.load(w_ptr + offs_c * 4, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + offs_c * 4 + 1, mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + offs_c * 4 + 2, mask=cmask, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + offs_c * 4 + 3, mask=cmask, other=0.0).to(tl.float32)
    acc = t0 * w0
    acc = acc + t1 * w1
    acc = acc + t2 * w2
    acc = acc + x * w3
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + row * stride_y + offs_c, y, mask=cmask)
    # the tail keeps the last three pre-conv inputs, oldest first
    tl.store(tail, t1, mask=m)
    tl.store(tail + 1, t2, mask=m)
    tl.store(tail + 2, x, mask=m)


def _gdn_token(s, q, k, v, b, x, ssm_a, q_scale, l2_eps, ON_GPU: tl.constexpr):
    """One token of the gated delta rule on a state block s [DK, BV] from the token's conv output
    q, k [DK] (raw: l2-normalised here), v [BV], beta logit b and alpha + dt x: returns (s, o)."""
    q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + l2_eps) * q_scale
    k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + l2_eps)
    beta = 1.0 / (1.0 + tl.exp(-b))
    soft = libdevice.log1p(tl.exp(x)) if ON_GPU else tl.log(1.0 + tl.exp(x))
    soft = tl.where(x > 20.0, x, soft)
    g = ssm_a * soft
    s = s * tl.exp(g)
    predicted = tl.sum(s * k[:, None], axis=0)
    delta = beta * (v - predicted)
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    return s, o


def _gdn_step_kernel(
    conv_ptr, b_ptr, a_ptr, ssm_a_ptr, dt_ptr, base_ptr, rows_ptr, o_ptr,
    layer_off, stride_conv, stride_b, stride_a, q_scale, l2_eps,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BV: tl.constexpr, BLOCKS_FIRST: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    if BLOCKS_FIRST:
        row, block = tl.program_id(2), tl.program_id(0)
    else:
        row, block = tl.program_id(0), tl.program_id(2)
    h = tl.program_id(1)
    offs_v = block * BV + tl.arange(0, BV)
    offs_k = tl.arange(0, DK)
    live = tl.load(rows_ptr + row * 5 + 4)
    state_off = tl.load(rows_ptr + row * 5 + 2)
    hk = h // (HV // HQK)  # grouped value heads: value head h reads key head h // (HV / HQK)
    src = conv_ptr + row * stride_conv
    q = tl.load(src + hk * DK + offs_k)
    k = tl.load(src + HQK * DK + hk * DK + offs_k)
    v = tl.load(src + 2 * HQK * DK + h * DV + offs_v)
    b = tl.load(b_ptr + row * stride_b + h).to(tl.float32)
    x = tl.load(a_ptr + row * stride_a + h).to(tl.float32) + tl.load(dt_ptr + h).to(tl.float32)
    ssm_a = tl.load(ssm_a_ptr + h).to(tl.float32)
    ptrs = base_ptr + state_off + layer_off + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    smask = (offs_k[:, None] * 0 + offs_v[None, :] * 0 + live) != 0
    s = tl.load(ptrs, mask=smask, other=0.0)
    s, o = _gdn_token(s, q, k, v, b, x, ssm_a, q_scale, l2_eps, ON_GPU)
    tl.store(ptrs, s, mask=smask)
    tl.store(o_ptr + (row * HV + h) * DV + offs_v, o)


_gdn_token = helper(_gdn_token)  # type: ignore[assignment]
_conv = kernel(_conv_step_kernel)
_gdn = kernel(_gdn_step_kernel)


def _check_rows(rows: torch.Tensor, b: int) -> None:
    if rows.dtype != torch.int64 or rows.shape != (b, ROW_FIELDS) or not rows.is_contiguous():
        raise ValueError(
            f"rows must be contiguous int64 [{b}, {ROW_FIELDS}], got {rows.dtype} {tuple(rows.shape)}"
        )


def conv_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    base: torch.Tensor,
    rows: torch.Tensor,
    layer_off: int,
    *,
    backend: Backend = "triton",
) -> torch.Tensor:
    """SiLU(causal conv) of x [B, C] (each row's new input) against its tail; tails shift in place.

    Row b's tail is the [C, 3] fp32 block at base + rows[b, CONV_OFF] + layer_off. Returns fp32 [B, C].
    """
    b, c = x.shape
    if weight.shape != (c, CONV_WIDTH):
        raise ValueError(f"conv weight must be [{c}, {CONV_WIDTH}], got {tuple(weight.shape)}")
    _check_rows(rows, b)
    if not use_triton(backend, x):
        return conv_step_reference(x, weight, base, rows, layer_off)
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(b, c, dtype=torch.float32, device=x.device)
    grid = (cdiv(c, BLOCK_C), b) if BLOCKS_FIRST else (b, cdiv(c, BLOCK_C))
    _conv[grid](
        x, weight.contiguous(), base, rows, y, layer_off, c, x.stride(0), y.stride(0),
        BC=BLOCK_C, BLOCKS_FIRST=BLOCKS_FIRST, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return y


def gdn_step(
    conv: torch.Tensor,
    b_raw: torch.Tensor,
    a_raw: torch.Tensor,
    ssm_a: torch.Tensor,
    dt: torch.Tensor,
    base: torch.Tensor,
    rows: torch.Tensor,
    layer_off: int,
    *,
    num_k_heads: int,
    num_v_heads: int,
    k_dim: int,
    v_dim: int,
    backend: Backend = "triton",
) -> torch.Tensor:
    """One delta-rule step per row from the conv output [B, 2*HQK*dk + HV*dv] (q | k | v).

    b_raw, a_raw [B, HV]: the beta and alpha projections; ssm_a, dt [HV]. Row b's state is the
    [HV, dk, dv] fp32 block at base + rows[b, STATE_OFF] + layer_off, updated in place.
    Returns o fp32 [B, HV, dv].
    """
    b = conv.shape[0]
    _check_rows(rows, b)
    if conv.shape[1] != 2 * num_k_heads * k_dim + num_v_heads * v_dim:
        raise ValueError(f"conv rows have {conv.shape[1]} channels, not q|k|v of the given heads")
    if not use_triton(backend, conv):
        return gdn_step_reference(
            conv, b_raw, a_raw, ssm_a, dt, base, rows, layer_off, num_k_heads, num_v_heads, k_dim, v_dim
        )
    bv = BLOCK_V if v_dim % BLOCK_V == 0 else 16
    if k_dim & (k_dim - 1) or k_dim < 16 or v_dim % bv:
        raise ValueError(
            f"the kernel needs dk a power of two >= 16 and dv a multiple of 16, got {k_dim}, {v_dim}"
        )
    conv = conv.contiguous()
    o = torch.empty(b, num_v_heads, v_dim, dtype=torch.float32, device=conv.device)
    grid = (v_dim // bv, num_v_heads, b) if BLOCKS_FIRST else (b, num_v_heads, v_dim // bv)
    _gdn[grid](
        conv, b_raw, a_raw, ssm_a.contiguous(), dt.contiguous(), base, rows, o,
        layer_off, conv.stride(0), b_raw.stride(0), a_raw.stride(0),
        k_dim**-0.5, L2NORM_EPS,
        HQK=num_k_heads, HV=num_v_heads, DK=k_dim, DV=v_dim, BV=bv, BLOCKS_FIRST=BLOCKS_FIRST,
        num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return o


# ------------------------------------------------------------------------ torch references
def _block(base: torch.Tensor, off: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The fp32 block at base + off viewed as `shape` (a view: writes land in place)."""
    return torch.as_strided(base, shape, _contiguous_strides(shape), base.storage_offset() + off)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def conv_step_reference(
    x: torch.Tensor, weight: torch.Tensor, base: torch.Tensor, rows: torch.Tensor, layer_off: int
) -> torch.Tensor:
    """Row by row in torch (tails inside `base`'s storage only): the kernel's oracle."""
    b, c = x.shape
    y = torch.zeros(b, c, dtype=torch.float32, device=x.device)
    for r in range(b):
        if not int(rows[r, LIVE]):
            continue
        tail = _block(base, int(rows[r, CONV_OFF]) + layer_off, (c, CONV_WIDTH - 1))
        full = torch.cat([tail, x[r].float()[:, None]], dim=1)  # [C, 4] oldest -> newest
        y[r] = F.silu((full * weight.float()).sum(-1))
        tail.copy_(full[:, 1:])
    return y


def gdn_step_reference(
    conv: torch.Tensor,
    b_raw: torch.Tensor,
    a_raw: torch.Tensor,
    ssm_a: torch.Tensor,
    dt: torch.Tensor,
    base: torch.Tensor,
    rows: torch.Tensor,
    layer_off: int,
    hqk: int,
    hv: int,
    dk: int,
    dv: int,
) -> torch.Tensor:
    from engine.run.reference import gated_delta_rule, l2_normalize

    b = conv.shape[0]
    o = torch.zeros(b, hv, dv, dtype=torch.float32, device=conv.device)
    for r in range(b):
        if not int(rows[r, LIVE]):
            continue
        state = _block(base, int(rows[r, STATE_OFF]) + layer_off, (hv, dk, dv))
        q, k, v = torch.split(conv[r].float(), [hqk * dk, hqk * dk, hv * dv])
        q = (l2_normalize(q.view(1, hqk, dk)) * dk**-0.5).repeat_interleave(hv // hqk, dim=1)
        k = l2_normalize(k.view(1, hqk, dk)).repeat_interleave(hv // hqk, dim=1)
        beta = torch.sigmoid(b_raw[r : r + 1].float())
        g = ssm_a.float() * F.softplus(a_raw[r : r + 1].float() + dt.float())
        out, final = gated_delta_rule(q, k, v.view(1, hv, dv), g, beta, state.clone())
        o[r] = out[0]
        state.copy_(final)
    return o
