"""Gated DeltaNet recurrence over packed variable-length segments (fused recurrent form).

One program per (segment, value head, value-dim block) walks its segment's tokens in order
with the state block S[:, block] (fp32, [dk, BV]) in registers, applying exactly the rule of
`engine.reference.gated_delta_rule`:

    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - S^T k_t))^T;   o_t = S^T q_t

Segments read only their own tokens and initial state and the grid is fixed by
(segments, heads, dv / BV) with a config fixed by the head sizes, so a segment's outputs and
final state are bitwise the same whatever other segments share the launch. Empty segments
just copy their initial state to the final one, so padded segment tables work.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels._triton import Backend, kernel, use_triton
from engine.reference import gated_delta_rule

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

BLOCK_V = 32
NUM_WARPS = 4


def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, offsets_ptr, s0_ptr, o_ptr, sf_ptr,
    HQK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BV: tl.constexpr, HAS_S0: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    # grouped value heads: value head h reads key head h // (HV / HQK)
    i_hk = i_h // (HV // HQK)
    bos = tl.load(offsets_ptr + i_s).to(tl.int64)
    eos = tl.load(offsets_ptr + i_s + 1).to(tl.int64)

    offs_k = tl.arange(0, DK)
    offs_v = i_v * BV + tl.arange(0, BV)
    state_off = (i_s.to(tl.int64) * HV + i_h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(s0_ptr + state_off).to(tl.float32) if HAS_S0 else tl.zeros((DK, BV), dtype=tl.float32)

    for t in range(bos, eos):
        qk_base = (t * HQK + i_hk) * DK
        q = tl.load(q_ptr + qk_base + offs_k).to(tl.float32)
        k = tl.load(k_ptr + qk_base + offs_k).to(tl.float32)
        v = tl.load(v_ptr + (t * HV + i_h) * DV + offs_v).to(tl.float32)
        g = tl.load(g_ptr + t * HV + i_h).to(tl.float32)
        beta = tl.load(beta_ptr + t * HV + i_h).to(tl.float32)
        s = s * tl.exp(g)
        predicted = tl.sum(s * k[:, None], axis=0)
        delta = beta * (v - predicted)
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + (t * HV + i_h) * DV + offs_v, o)

    tl.store(sf_ptr + state_off, s)


_kernel = kernel(_gdn_recurrent_kernel)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    offsets: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(
            f"q and k must be [N, H, dk] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be [N, HV, dv] with N = {q.shape[0]}, got {tuple(v.shape)}")
    n, hqk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if hv % hqk:
        raise ValueError(f"value heads ({hv}) must be a multiple of query/key heads ({hqk})")
    if g.shape != (n, hv) or beta.shape != (n, hv):
        raise ValueError(f"g and beta must be [{n}, {hv}], got {tuple(g.shape)} and {tuple(beta.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 2 or offsets.dtype.is_floating_point:
        raise ValueError(f"offsets must be an integer tensor [S + 1] with S >= 1, got {tuple(offsets.shape)}")
    s = offsets.numel() - 1
    if initial_state is not None and initial_state.shape != (s, hv, dk, dv):
        raise ValueError(f"initial_state must be [{s}, {hv}, {dk}, {dv}], got {tuple(initial_state.shape)}")
    if offsets.device.type == "cpu":
        o = offsets.long()
        if int(o[0]) != 0 or bool((o[1:] < o[:-1]).any()) or int(o[-1]) > n:
            raise ValueError(
                f"offsets must start at 0, never decrease and end at most at N={n}: {o.tolist()}"
            )


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    offsets: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment loop over `engine.reference.gated_delta_rule` (fp32): the kernel's oracle."""
    n, hqk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    bounds = offsets.long().tolist()
    out = torch.zeros(n, hv, dv, dtype=torch.float32, device=v.device)
    final = torch.empty(len(bounds) - 1, hv, dk, dv, dtype=torch.float32, device=v.device)
    group = hv // hqk
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        s0 = (
            initial_state[i].float()
            if initial_state is not None
            else torch.zeros(hv, dk, dv, dtype=torch.float32, device=v.device)
        )
        if hi == lo:
            final[i] = s0
            continue
        qs = q[lo:hi].float().repeat_interleave(group, dim=1)
        ks = k[lo:hi].float().repeat_interleave(group, dim=1)
        out[lo:hi], final[i] = gated_delta_rule(
            qs, ks, v[lo:hi].float(), g[lo:hi].float(), beta[lo:hi].float(), s0
        )
    return out, final


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    offsets: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over packed segments: (o fp32 [N, HV, dv], final state fp32 [S, HV, dk, dv]).

    q, k [N, H, dk] (l2-normalized; q already scaled), with H dividing HV (value head h reads
    key head h // (HV / H)); v [N, HV, dv]; g (log decay) and beta [N, HV]; offsets [S + 1]
    token bounds of the segments (int, on the tensors' device); initial_state fp32
    [S, HV, dk, dv] or None (zeros). dk must be a power of two and dv a multiple of 32 for the
    kernel. Output rows of tokens outside every segment are unspecified.
    """
    _check(q, k, v, g, beta, offsets, initial_state)
    if not use_triton(backend, v):
        return gated_delta_rule_reference(q, k, v, g, beta, offsets, initial_state)
    n, hqk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    bv = BLOCK_V if dv % BLOCK_V == 0 else 16  # 16 for the tiny test models' dv=16 heads
    if dk & (dk - 1) or dk < 16 or dv % bv:
        raise ValueError(f"the kernel needs dk a power of two >= 16 and dv a multiple of 16, got {dk}, {dv}")
    s = offsets.numel() - 1
    out = torch.empty(n, hv, dv, dtype=torch.float32, device=v.device)
    final = torch.empty(s, hv, dk, dv, dtype=torch.float32, device=v.device)
    s0 = initial_state.contiguous() if initial_state is not None else final
    _kernel[(s, hv, dv // bv)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        offsets.to(torch.int32), s0, out, final,
        HQK=hqk, HV=hv, DK=dk, DV=dv, BV=bv, HAS_S0=initial_state is not None,
        num_warps=NUM_WARPS, enable_fp_fusion=True,
    )  # fmt: skip
    return out, final
