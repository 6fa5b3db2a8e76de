"""The MLP's gate and up in their stored layout: interleaved, gate j then up j.

Why this layout: a GEMM tile over the stacked gate+up weight then holds both values of each SwiGLU
output, so Hopper's CUTLASS GEMM pairs them in one thread's registers and writes only v
(`cutlass_gemm.Library.swiglu_pairs`). Every reader of the stacked weight or its output takes gate
and up as its even and odd rows or columns; these two functions are that rule, written once.
"""

from __future__ import annotations

import torch


def interleave_gate_up(gate: torch.Tensor, up: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """gate and up of one shape side by side along `dim`, alternating: index 2j of the result is
    gate's j and 2j + 1 up's. Weights [I, K] and scales [I] along dim 0 (the stored layout);
    outputs [B, I] along dim -1 (what the stacked GEMM gives). A copy; only the order changes."""
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(f"gate and up: one shape, at least 1-D, got {tuple(gate.shape)}, {tuple(up.shape)}")
    d = dim % gate.dim()
    return torch.stack((gate, up), dim=d + 1).flatten(d, d + 1)


def split_gate_up(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up): the even and odd indices of x along `dim` (views), `interleave_gate_up`'s inverse."""
    if x.shape[dim] % 2:
        raise ValueError(f"interleaved gate and up need an even size along dim {dim}, got {tuple(x.shape)}")
    d = dim % x.dim()
    index: list[slice] = [slice(None)] * x.dim()
    gate, up = (x[tuple([*index[:d], slice(i, None, 2), *index[d + 1 :]])] for i in range(2))
    return gate, up
