"""Causal depthwise conv (width W, 4 in qwen35) + SiLU over packed segments with per-segment tails.

Token t of segment s (local position p) sees the W inputs at local positions p-W+1 .. p,
taking those before the segment start from the segment's initial tail [C, W-1] (oldest
first, as `engine.reference.causal_conv` keeps it). Programs tile (token block, channel
block) of the packed level and look up each token's segment in a device-side table, so every
output element is the same W-term sum in the same order whatever else is packed around it.
The last token of each segment also writes that segment's final tail; extra programs copy
the initial tail of empty segments, so padded segment tables work.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels._triton import Backend, cdiv, kernel, use_triton
from engine.reference import causal_conv

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

BLOCK_T = 16
BLOCK_C = 128
BLOCK_S = 16
NUM_WARPS = 4


def _conv_kernel(
    x_ptr, w_ptr, seg_ptr, offsets_ptr, tail0_ptr, y_ptr, tailf_ptr,
    N, C, S, stride_x, stride_y, num_t_blocks,
    W: tl.constexpr, HAS_TAIL: tl.constexpr, SILU: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BS: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_c = pid_c * BC + tl.arange(0, BC)
    cmask = offs_c < C
    if pid_t < num_t_blocks:
        offs_t = pid_t * BT + tl.arange(0, BT)
        seg = tl.load(seg_ptr + offs_t, mask=offs_t < N, other=S)
        tmask = (offs_t < N) & (seg < S)
        seg = tl.where(tmask, seg, 0).to(tl.int64)
        bos = tl.load(offsets_ptr + seg)
        eos = tl.load(offsets_ptr + seg + 1)
        pos = offs_t - bos
        is_last = tmask & (offs_t == eos - 1)
        mask2 = tmask[:, None] & cmask[None, :]
        tail_row = (seg[:, None] * C + offs_c[None, :]) * (W - 1)
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for j in tl.static_range(W):
            lp = pos - (W - 1) + j  # local position of window element j
            in_seg = lp >= 0
            xv = tl.load(
                x_ptr + (offs_t - (W - 1) + j).to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                mask=mask2 & in_seg[:, None],
                other=0.0,
            ).to(tl.float32)
            if HAS_TAIL:
                tv = tl.load(
                    tail0_ptr + tail_row + (lp + (W - 1))[:, None], mask=mask2 & (lp < 0)[:, None], other=0.0
                ).to(tl.float32)
                xv = tl.where(in_seg[:, None], xv, tv)
            wj = tl.load(w_ptr + offs_c * W + j, mask=cmask, other=0.0).to(tl.float32)
            acc += xv * wj[None, :]
            if j >= 1:
                tl.store(tailf_ptr + tail_row + (j - 1), xv, mask=is_last[:, None] & cmask[None, :])
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * stride_y + offs_c[None, :], acc, mask=mask2)
    else:
        # empty segments: the final tail is the initial one
        offs_s = (pid_t - num_t_blocks) * BS + tl.arange(0, BS)
        smask = offs_s < S
        bos = tl.load(offsets_ptr + offs_s, mask=smask, other=0)
        eos = tl.load(offsets_ptr + offs_s + 1, mask=smask, other=0)
        empty = smask & (eos == bos)
        for j in tl.static_range(W - 1):
            ptrs = (offs_s.to(tl.int64)[:, None] * C + offs_c[None, :]) * (W - 1) + j
            m = empty[:, None] & cmask[None, :]
            if HAS_TAIL:
                tv = tl.load(tail0_ptr + ptrs, mask=m, other=0.0)
            else:
                tv = tl.zeros((BS, BC), dtype=tl.float32)
            tl.store(tailf_ptr + ptrs, tv, mask=m)


_kernel = kernel(_conv_kernel)


def causal_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    initial_tail: torch.Tensor | None = None,
    *,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment loop over `engine.reference.causal_conv` (fp32): the kernel's oracle."""
    n, c = x.shape
    w = weight.shape[1]
    bounds = offsets.long().tolist()
    y = torch.zeros(n, c, dtype=torch.float32, device=x.device)
    tails = torch.empty(len(bounds) - 1, c, w - 1, dtype=torch.float32, device=x.device)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        tail = (
            initial_tail[i].float()
            if initial_tail is not None
            else torch.zeros(c, w - 1, dtype=torch.float32, device=x.device)
        )
        if hi == lo:
            tails[i] = tail
            continue
        out, tails[i] = causal_conv(x[lo:hi].float(), tail, weight.float())
        y[lo:hi] = F.silu(out) if silu else out
    return y, tails


def causal_conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    initial_tail: torch.Tensor | None = None,
    *,
    silu: bool = True,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (+ SiLU) of packed x [N, C]: (y fp32 [N, C], final tails fp32 [S, C, W-1]).

    weight [C, W] (taps oldest to newest); offsets [S + 1] int segment bounds on x's device;
    initial_tail [S, C, W-1] (oldest first) or None (zeros). The tails hold pre-conv inputs.
    Output rows of tokens outside every segment are unspecified.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(
            f"need x [N, C] and weight [C, W >= 2], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if offsets.dim() != 1 or offsets.numel() < 2 or offsets.dtype.is_floating_point:
        raise ValueError(f"offsets must be an integer tensor [S + 1] with S >= 1, got {tuple(offsets.shape)}")
    n, c = x.shape
    w = weight.shape[1]
    s = offsets.numel() - 1
    if initial_tail is not None and initial_tail.shape != (s, c, w - 1):
        raise ValueError(f"initial_tail must be [{s}, {c}, {w - 1}], got {tuple(initial_tail.shape)}")
    if offsets.device.type == "cpu":
        o = offsets.long()
        if int(o[0]) != 0 or bool((o[1:] < o[:-1]).any()) or int(o[-1]) > n:
            raise ValueError(
                f"offsets must start at 0, never decrease and end at most at N={n}: {o.tolist()}"
            )
    if not use_triton(backend, x):
        return causal_conv_reference(x, weight, offsets, initial_tail, silu=silu)
    x = x if x.stride(1) == 1 else x.contiguous()
    offsets = offsets.to(device=x.device, dtype=torch.int32)
    # segment of each packed token (tokens past the last bound get S and are skipped)
    seg = torch.searchsorted(offsets[1:], torch.arange(n, device=x.device, dtype=torch.int32), right=True)
    y = torch.empty(n, c, dtype=torch.float32, device=x.device)
    tails = torch.empty(s, c, w - 1, dtype=torch.float32, device=x.device)
    t_blocks = cdiv(n, BLOCK_T)
    grid = (t_blocks + cdiv(s, BLOCK_S), cdiv(c, BLOCK_C))
    _kernel[grid](
        x, weight.contiguous(), seg.to(torch.int32), offsets,
        initial_tail.contiguous() if initial_tail is not None else tails, y, tails,
        n, c, s, x.stride(0), y.stride(0), t_blocks,
        W=w, HAS_TAIL=initial_tail is not None, SILU=silu, BT=BLOCK_T, BC=BLOCK_C, BS=BLOCK_S,
        num_warps=NUM_WARPS, enable_fp_fusion=True,
    )  # fmt: skip
    return y, tails
