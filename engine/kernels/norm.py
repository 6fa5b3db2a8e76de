"""Row normalization with a fixed reduction order: RMSNorm and L2 norm, one program per row.

    rms: y = (x * rsqrt(sum(x^2) / K + eps)) * w        l2: y = x * rsqrt(sum(x^2) + eps)

torch's CUDA reductions pick their thread layout from the tensor's shape, so a row's sum of
squares can be added up in a different order when the call has a different number of rows;
here each row is reduced by one program whose block size depends on K alone, so a row's bits
never depend on the batch. The torch reference computes the same formula (the value agrees to
rounding, not bit for bit).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels._triton import Backend, kernel, next_pow2, use_triton

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

MAX_BLOCK = 4096
UNROLL = 1  # blocks of a row pass unrolled together (engine.kernels.quant.UNROLL: rolled, as measured)


def _norm_row_kernel(
    x_ptr, w_ptr, y_ptr, K, stride_x, stride_y, eps,
    MEAN: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
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


_kernel = kernel(_norm_row_kernel)


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
    w = weight.contiguous() if weight is not None else y
    _kernel[(x2.shape[0],)](
        x2, w, y, k, x2.stride(0), y.stride(0), float(eps),
        MEAN=mean, HAS_W=weight is not None, BLOCK=block, UNROLL=UNROLL,
        num_warps=8 if block >= 2048 else 4, enable_fp_fusion=False,
    )  # fmt: skip
    return y.reshape(*lead, k)
