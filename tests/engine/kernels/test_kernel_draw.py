"""The device draw (engine.kernels.draw) gives the host sampler's token for every row.

Oracles: `engine.decide.sampling._draw` over each packed row's candidates (itself tested against
exact rational arithmetic in tests/engine/test_portable_exp.py), and, end to end, the host's
`sample_tokens` over the same logits, whose top-k is the torch form with its own tie handling:
the kernel's rows come from `row_top_k`, so a tie across the cut and ties inside the k are
resolved by the packed order alone. On CPU the kernel runs in Triton's interpreter, compiled on
CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.decide.sampling import sample_tokens
from engine.kernels.draw import constants, draw_tokens, draw_tokens_reference
from engine.kernels.top_k import row_top_k_reference

SETTINGS = [(0.6, 0.95), (1.0, 1.0), (0.3, 0.5), (1.7, 0.9), (0.05, 0.99), (0.6, 0.0)]


def _logits(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows, peaked and flat, with ties inside the k, across the cut, -inf tails and
    signed zeros."""
    x = torch.randn(n, vocab, generator=gen) * 3
    x[0] = torch.round(x[0])  # many ties, one straddling the cut
    x[1, :] = float("-inf")
    x[1, [4, 9, 30]] = torch.tensor([1.0, 1.0, -2.0])  # three finite logits only
    x[2, 17] = 40.0  # almost one-hot
    x[3] = torch.where(torch.rand(vocab, generator=gen) < 0.5, 0.0, -0.0)  # every logit zero
    x[4] = torch.round(x[4] * 2) / 2
    x[4, :30] = x[4].max()  # 30 tied maxima: the cut inside the tie
    x[5:] *= torch.linspace(0.1, 4.0, n - 5)[:, None]  # flat to peaked
    return x


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s[0]}-p{s[1]}")
def test_the_kernel_draws_the_host_samplers_token(setting: tuple[float, float], dev: torch.device) -> None:
    temperature, top_p = setting
    k, vocab, n = 20, 300, 24
    gen = torch.Generator().manual_seed(3)
    x = _logits(n, vocab, gen)
    rng = random.Random(7)
    us = [rng.random() for _ in range(n)]
    us[5], us[6] = 0.0, 1.0 - 2.0**-53  # the ends of [0, 1)
    packed = row_top_k_reference(x, k).to(dev)
    u = torch.tensor(us, dtype=torch.float64, device=dev)
    expected = draw_tokens_reference(packed, u, k, temperature, top_p)
    assert expected.tolist() == sample_tokens(x, us, temperature=temperature, top_p=top_p, top_k=k)
    got = draw_tokens(packed, u, k, temperature, top_p, backend="triton")
    assert got.tolist() == expected.tolist()


def test_the_kernel_draws_every_uniform_like_the_host(dev: torch.device) -> None:
    """One flat row, u swept across [0, 1): every boundary between candidates is crossed, and a
    table made once serves every call."""
    k, vocab, n = 8, 64, 64
    x = (torch.arange(vocab, dtype=torch.float32) % 11 / 5.0).repeat(n, 1)
    packed = row_top_k_reference(x, k).to(dev)
    u = torch.tensor([(i + 0.5) / n for i in range(n)], dtype=torch.float64, device=dev)
    table = constants(1.3, 0.97, dev)
    got = draw_tokens(packed, u, k, 1.3, 0.97, table=table, backend="triton")
    assert got.tolist() == draw_tokens_reference(packed, u, k, 1.3, 0.97).tolist()
    assert len(set(got.tolist())) > 3  # the sweep reaches several candidates


def test_rows_with_nan_and_greedy_rows(dev: torch.device) -> None:
    """A NaN row gives -1 (its caller falls back to the host, which refuses it); temperature 0
    draws the first candidate, the lowest id among the maxima."""
    k = 5
    x = torch.zeros(3, 50)
    x[0, 7] = float("nan")
    x[1, [3, 9, 12]] = 2.0
    x[2, 40] = 1.0
    packed = row_top_k_reference(x, k).to(dev)
    u = torch.full((3,), 0.5, dtype=torch.float64, device=dev)
    assert draw_tokens(packed, u, k, 0.6, 0.95, backend="triton").tolist()[0] == -1
    assert draw_tokens(packed, u, k, 0.0, 0.95, backend="triton").tolist() == [-1, 3, 40]
    assert sample_tokens(x[1:], [0.5, 0.5], temperature=0.0, top_p=0.95, top_k=k) == [3, 40]


def test_draw_tokens_checks_its_inputs() -> None:
    packed = torch.zeros(2, 12, dtype=torch.int64)
    u = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="packed must be"):
        draw_tokens(packed, u, 4, 0.6, 0.95)
    with pytest.raises(ValueError, match="us must be"):
        draw_tokens(packed, u.float(), 5, 0.6, 0.95)
    with pytest.raises(ValueError, match="table must be"):
        draw_tokens(packed, u, 5, 0.6, 0.95, table=torch.zeros(22), backend="triton")
