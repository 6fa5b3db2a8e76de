"""Varlen causal conv + SiLU kernel: matches the reference conv; tails; segment independence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.conv import causal_conv_reference, causal_conv_varlen
from engine.reference import causal_conv

ON_CUDA = torch.cuda.is_available()
C = 10240 if ON_CUDA else 40  # the 27B qkv conv width on CUDA


def _inputs(gen: torch.Generator, lens: list[int], dev: torch.device, extra: int = 0):
    n = sum(lens)
    x = torch.randn(n + extra, C, generator=gen)
    w = torch.randn(C, 4, generator=gen) * 0.5
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tail = torch.randn(len(lens), C, 3, generator=gen)
    return [t.to(dev) for t in (x, w, offsets, tail)]


def test_reference_continues_the_single_sequence_conv(gen: torch.Generator) -> None:
    x, w, offsets, tail = _inputs(gen, [2, 5], torch.device("cpu"))
    y, tails = causal_conv_reference(x, w, offsets, tail)
    out, t1 = causal_conv(x[2:], tail[1], w)
    assert torch.equal(y[2:], F.silu(out)) and torch.equal(tails[1], t1)
    # a 2-token segment's final tail still holds one input of its initial tail
    assert torch.equal(tails[0][:, 0], tail[0][:, 2]) and torch.equal(tails[0][:, 1:], x[:2].T)


@pytest.mark.parametrize("with_tail", [True, False])
@pytest.mark.parametrize("silu", [True, False])
def test_kernel_matches_reference(
    gen: torch.Generator, dev: torch.device, with_tail: bool, silu: bool
) -> None:
    lens = [3, 0, 5, 1, 2, 20]
    x, w, offsets, tail = _inputs(gen, lens, dev, extra=2)  # 2 padding tokens past the last segment
    init = tail if with_tail else None
    y, tails = causal_conv_varlen(x, w, offsets, init, silu=silu, backend="triton")
    y_ref, t_ref = causal_conv_reference(x, w, offsets, init, silu=silu)
    n = sum(lens)
    torch.testing.assert_close(y[:n], y_ref[:n], rtol=1e-5, atol=1e-5)
    assert torch.equal(tails, t_ref)  # tails are copies of inputs: exact


def test_segment_alone_equals_segment_among_others(gen: torch.Generator, dev: torch.device) -> None:
    lens = [4, 1, 7, 2] if not ON_CUDA else [300, 1, 256, 5]
    x, w, offsets, tail = _inputs(gen, lens, dev)
    y_all, t_all = causal_conv_varlen(x, w, offsets, tail, backend="triton")
    bounds = offsets.tolist()
    for i in range(len(lens)):
        lo, hi = bounds[i], bounds[i + 1]
        alone = torch.tensor([0, hi - lo], dtype=torch.int32, device=dev)
        y, t = causal_conv_varlen(x[lo:hi], w, alone, tail[i : i + 1], backend="triton")
        assert torch.equal(y, y_all[lo:hi]) and torch.equal(t[0], t_all[i])


def test_bad_inputs_are_named(gen: torch.Generator) -> None:
    x, w, offsets, tail = _inputs(gen, [2, 2], torch.device("cpu"))
    with pytest.raises(ValueError, match="weight"):
        causal_conv_varlen(x, w[:3], offsets, tail)
    with pytest.raises(ValueError, match="initial_tail"):
        causal_conv_varlen(x, w, offsets, tail[:, :, :2])
    with pytest.raises(ValueError, match="offsets"):
        causal_conv_varlen(x, w, torch.tensor([1, 2, 4]), tail)
