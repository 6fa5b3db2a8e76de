"""Gated DeltaNet varlen kernel: matches the token-by-token reference; segments are independent."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.deltanet import gated_delta_rule_reference, gated_delta_rule_varlen
from engine.reference import gated_delta_rule, l2_normalize

ON_CUDA = torch.cuda.is_available()
# CPU (interpreter): tiny heads; CUDA: the 27B layer's head sizes
HQK, HV, DK, DV = (16, 48, 128, 128) if ON_CUDA else (2, 4, 16, 32)


def _inputs(gen: torch.Generator, lens: list[int], dev: torch.device):
    n = sum(lens)
    q = l2_normalize(torch.randn(n, HQK, DK, generator=gen)) * DK**-0.5
    k = l2_normalize(torch.randn(n, HQK, DK, generator=gen))
    v = torch.randn(n, HV, DV, generator=gen)
    g = -torch.rand(n, HV, generator=gen) * 2
    beta = torch.rand(n, HV, generator=gen)
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    s0 = torch.randn(len(lens), HV, DK, DV, generator=gen) * 0.2
    return [t.to(dev) for t in (q, k, v, g, beta, offsets, s0)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_reference_is_the_single_sequence_rule(gen: torch.Generator) -> None:
    q, k, v, g, beta, offsets, s0 = _inputs(gen, [4, 3], torch.device("cpu"))
    o, final = gated_delta_rule_reference(q, k, v, g, beta, offsets, s0)
    group = HV // HQK
    o1, f1 = gated_delta_rule(
        q[4:].repeat_interleave(group, 1), k[4:].repeat_interleave(group, 1), v[4:], g[4:], beta[4:], s0[1]
    )
    assert torch.equal(o[4:], o1) and torch.equal(final[1], f1)


@pytest.mark.parametrize("with_state", [True, False])
def test_kernel_matches_reference(gen: torch.Generator, dev: torch.device, with_state: bool) -> None:
    lens = [5, 0, 9, 1, 3]
    q, k, v, g, beta, offsets, s0 = _inputs(gen, lens, dev)
    init = s0 if with_state else None
    o, final = gated_delta_rule_varlen(q, k, v, g, beta, offsets, init, backend="triton")
    o_ref, f_ref = gated_delta_rule_reference(q, k, v, g, beta, offsets, init)
    assert _rel(o, o_ref) <= 1e-5
    assert _rel(final, f_ref) <= 1e-5
    # the empty segment passes its initial state through untouched
    assert torch.equal(final[1], init[1] if init is not None else torch.zeros_like(final[1]))


def test_segment_alone_equals_segment_among_others(gen: torch.Generator, dev: torch.device) -> None:
    lens = [3, 7, 2, 6] if not ON_CUDA else [300, 17, 256, 1, 64]
    q, k, v, g, beta, offsets, s0 = _inputs(gen, lens, dev)
    o_all, f_all = gated_delta_rule_varlen(q, k, v, g, beta, offsets, s0, backend="triton")
    bounds = offsets.tolist()
    for i in (1, len(lens) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        alone = torch.tensor([0, hi - lo], dtype=torch.int32, device=dev)
        o, f = gated_delta_rule_varlen(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], alone, s0[i : i + 1], backend="triton"
        )
        assert torch.equal(o, o_all[lo:hi])
        assert torch.equal(f[0], f_all[i])


def test_prefix_then_suffix_equals_whole(gen: torch.Generator, dev: torch.device) -> None:
    """The recurrent form is exact under splitting: a cached prefix state gives identical bits."""
    q, k, v, g, beta, _, s0 = _inputs(gen, [8], dev)
    whole = torch.tensor([0, 8], dtype=torch.int32, device=dev)
    o, f = gated_delta_rule_varlen(q, k, v, g, beta, whole, s0, backend="triton")
    split = torch.tensor([0, 5], dtype=torch.int32, device=dev)
    o1, f1 = gated_delta_rule_varlen(q[:5], k[:5], v[:5], g[:5], beta[:5], split, s0, backend="triton")
    rest = torch.tensor([0, 3], dtype=torch.int32, device=dev)
    o2, f2 = gated_delta_rule_varlen(q[5:], k[5:], v[5:], g[5:], beta[5:], rest, f1, backend="triton")
    assert torch.equal(torch.cat([o1, o2]), o) and torch.equal(f2, f)


def test_bad_inputs_are_named(gen: torch.Generator) -> None:
    q, k, v, g, beta, offsets, s0 = _inputs(gen, [2, 2], torch.device("cpu"))
    with pytest.raises(ValueError, match="g and beta"):
        gated_delta_rule_varlen(q, k, v, g[:, :1], beta, offsets, s0)
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule_varlen(q, k, v, g, beta, offsets, s0[:1])
    with pytest.raises(ValueError, match="offsets must start at 0"):
        gated_delta_rule_varlen(q, k, v, g, beta, torch.tensor([0, 3, 2]), s0)
