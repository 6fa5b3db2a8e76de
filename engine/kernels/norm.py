"""Row normalization with a fixed reduction order: RMSNorm and L2 norm, one program per row.

    rms: y = (x * rsqrt(sum(x^2) / K + eps)) * w        l2: y = x * rsqrt(sum(x^2) + eps)

torch's CUDA reductions pick their thread layout from the tensor's shape, so a row's sum of
squares can be added up in a different order when the call has a different number of rows;
here each row is reduced by one program whose block size depends on K alone, so a row's bits
never depend on the batch. The torch reference computes the same formula (the value agrees to
rounding, not bit for bit).

A row of up to RESIDENT_VALUES values a thread (K <= 8,192) is loaded once and kept in
registers for the output pass (`_norm_resident_kernel`); a longer one (e.g. 10,240) is read
twice (`_norm_long_row_kernel`). Same block and warps, so the same order of the sum, and the
same elementwise ops: the same bits. On the H200 the resident kernel was 1.02-1.09x faster
(bench_rows.py, 2026-12-02; ops/bench/NOTES-kernels.md).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels._triton import Backend, cdiv, kernel, next_pow2, use_triton

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

MAX_BLOCK = 4096
RESIDENT_VALUES = 32  # 0: every row through the long-row kernel (bench_rows.py times both so)
LONG_ROW_UNROLL = 1  # the long-row passes rolled (engine.kernels.quant.LONG_ROW_UNROLL, as measured)


def _norm_resident_kernel(
    x_ptr, w_ptr, y_ptr, K, stride_x, stride_y, eps,
    MEAN: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """One row, read once: its NB = cdiv(K, BLOCK) blocks are loaded together and kept in
    registers for the output pass. The sum of squares accumulates per lane in block order,
    then `tl.sum` over [BLOCK]: `_norm_long_row_kernel`'s order at the same BLOCK and warps."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    offs = tl.arange(0, BLOCK)
    xs = ()
    for b in tl.static_range(NB):
        xs = xs + (tl.load(x_row + b * BLOCK + offs, mask=b * BLOCK + offs < K, other=0.0).to(tl.float32),)
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for b in tl.static_range(NB):
        sq += xs[b] * xs[b]
    total = tl.sum(sq, axis=0)
    if MEAN:
        total = tl.math.div_rn(total, K.to(tl.float32))
    inv = tl.math.rsqrt(total + eps)
    for b in tl.static_range(NB):
        m = b * BLOCK + offs < K
        v = xs[b] * inv
        if HAS_W:
            v = v * tl.load(w_ptr + b * BLOCK + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + b * BLOCK + offs, v, mask=m)


def _norm_long_row_kernel(
    x_ptr, w_ptr, y_ptr, K, stride_x, stride_y, eps,
    MEAN: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """A row too long for `_norm_resident_kernel`'s registers: read once for the sum of
    squares and again for the output, same blocks and operations."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    offs = tl.arange(0, BLOCK)
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK, loop_unroll_factor=UNROLL):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        sq += x * x
    total = tl.sum(sq, axis=0)
    if MEAN:
        total = tl.math.div_rn(total, K.to(tl.float32))
    inv = tl.math.rsqrt(total + eps)
    for k0 in tl.range(0, K, BLOCK, loop_unroll_factor=UNROLL):
        m = k0 + offs < K
        v = tl.load(x_row + k0 + offs, mask=m, other=0.0).to(tl.float32) * inv
        if HAS_W:
            v = v * tl.load(w_ptr + k0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + k0 + offs, v, mask=m)


_resident = kernel(_norm_resident_kernel)
_long_row = kernel(_norm_long_row_kernel)


def norm_rows_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, mean: bool) -> torch.Tensor:
    xf = x.float()
    sq = xf.pow(2).mean(-1, keepdim=True) if mean else xf.pow(2).sum(-1, keepdim=True)
    y = xf * torch.rsqrt(sq + eps)
    return y * weight.float() if weight is not None else y


def norm_rows(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    mean: bool = True,
    backend: Backend = "auto",
) -> torch.Tensor:
    """RMSNorm (mean=True) or L2 norm (mean=False) over the last axis of x [..., K]; fp32 out."""
    k = x.shape[-1]
    if weight is not None and weight.shape != (k,):
        raise ValueError(f"norm_rows: weight must be [{k}], got {tuple(weight.shape)}")
    if not use_triton(backend, x):
        return norm_rows_reference(x, weight, eps, mean)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.shape[0] == 0 or k == 0:
        return y.reshape(*lead, k)
    block = min(next_pow2(k), MAX_BLOCK)
    warps = 8 if block >= 2048 else 4
    w = weight.contiguous() if weight is not None else y
    nb = cdiv(k, block)
    if nb * block <= RESIDENT_VALUES * 32 * warps:
        _resident[(x2.shape[0],)](
            x2, w, y, k, x2.stride(0), y.stride(0), float(eps),
            MEAN=mean, HAS_W=weight is not None, BLOCK=block, NB=nb,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
        return y.reshape(*lead, k)
    _long_row[(x2.shape[0],)](
        x2, w, y, k, x2.stride(0), y.stride(0), float(eps),
        MEAN=mean, HAS_W=weight is not None, BLOCK=block, UNROLL=LONG_ROW_UNROLL,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return y.reshape(*lead, k)
