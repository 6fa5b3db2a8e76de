"""Activations whose bits do not depend on where an element sits in its tensor (CPU).

torch's CPU kernels for sigmoid, silu and softplus compute a vectorized body and a scalar
tail, and the two can differ by an ulp; which elements fall in the tail depends on the
tensor's size. Under tensor parallelism a rank holds a different number of heads than one
device does, so the same element lands in a different place. These forms are built from
operations whose CPU kernels give the same bits in body and tail alike: `exp` and `log`
(evaluated through the vectorized math library even for a partial vector) and correctly
rounded add, multiply and divide. tests/engine/test_elementwise.py checks that property.

GPU kernels evaluate every element with the same instructions, so on CUDA tensors these
functions are torch's fused activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# torch's softplus threshold: above it softplus(x) is x in fp32
SOFTPLUS_THRESHOLD = 20.0


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x) if x.is_cuda else 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if x.is_cuda else x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), with log1p from log alone: log1p(e) = log(u) * e / (u - 1), u = 1 + e.

    The quotient corrects the rounding of u (Goldberg's identity), so small e keep their
    relative accuracy without torch.log1p, whose CPU body and tail differ.
    """
    if x.is_cuda:
        return F.softplus(x)
    e = torch.exp(torch.clamp(x, max=SOFTPLUS_THRESHOLD))
    u = 1.0 + e
    log1p = torch.where(u == 1.0, e, torch.log(u) * e / (u - 1.0))
    return torch.where(x > SOFTPLUS_THRESHOLD, x, log1p)
