"""The batched sampler returns, row by row, exactly what `sample_token` returns for that row."""

from __future__ import annotations

import random

import pytest
import torch

from engine.decide.sampling import sample_token, sample_tokens

VOCAB = 4096
SETTINGS = [
    dict(temperature=0.6, top_p=0.95, top_k=20),  # the decision config's defaults
    dict(temperature=1.0, top_p=1.0, top_k=5),
    dict(temperature=0.3, top_p=0.5, top_k=1),
    dict(temperature=1.7, top_p=0.9, top_k=0),  # top-k off
    dict(temperature=0.0, top_p=0.95, top_k=20),  # greedy
    dict(temperature=1.0, top_p=1.0, top_k=VOCAB + 3),  # k past the vocabulary
]


def _rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """Random logits with the awkward cases: ties at and around the top-k cut, -inf, one hot."""
    x = torch.randn(n, VOCAB, generator=gen) * 3
    x[0] = 0.0  # every logit tied
    x[1, ::7] = x[1].max() + 1  # hundreds of tied maxima
    x[2] = torch.round(x[2])  # many ties everywhere, including across the 20th place
    x[3, :] = float("-inf")
    x[3, [5, 900, 17]] = torch.tensor([1.0, 1.0, -2.0])  # three finite logits only
    x[4, 123] = 50.0  # almost one-hot
    x[5] = torch.round(x[5] * 2) / 2
    x[5, :40] = x[5].max()  # 40 tied maxima: the cut falls inside the tie
    return x


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "T{temperature}-p{top_p}-k{top_k}".format(**s))
def test_batched_sampler_equals_sample_token_row_by_row(setting: dict, device: str) -> None:
    """On the logits' own device (the decoder's are on the GPU): top-k there, the draw on the host."""
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(3)
    logits = _rows(48, gen)
    us = [rng.random() for _ in range(48)]
    us[6], us[7] = 0.0, 1.0 - 2.0**-53  # the ends of [0, 1)
    expected = [sample_token(logits[r], u, **setting) for r, u in enumerate(us)]
    assert sample_tokens(logits.to(device), us, **setting) == expected


def test_the_draw_follows_the_documented_arithmetic() -> None:
    """A hand-computed case: logits 2, 1, 0 at T = 1 give weights 1, e^-1, e^-2 (sum 1.5032);
    top-p 0.9 keeps the first two (0.6652 + 0.2447 = 0.9099 >= 0.9); u splits that head at
    0.6652 / 0.9099 = 0.7311 of its mass."""
    logits = torch.full((1, 8), -30.0)
    logits[0, 5], logits[0, 2], logits[0, 7] = 2.0, 1.0, 0.0
    setting = dict(temperature=1.0, top_p=0.9, top_k=3)
    assert sample_tokens(logits, [0.73], **setting) == [5]
    assert sample_tokens(logits, [0.74], **setting) == [2]
    assert sample_tokens(logits, [0.999], **setting) == [2]  # the third is cut by top-p


def test_batched_sampler_is_row_independent() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = _rows(16, gen)
    us = [(i + 0.5) / 16 for i in range(16)]
    setting = SETTINGS[0]
    together = sample_tokens(logits, us, **setting)
    perm = list(range(16))
    random.Random(5).shuffle(perm)
    shuffled = sample_tokens(logits[perm], [us[p] for p in perm], **setting)
    assert [shuffled[perm.index(r)] for r in range(16)] == together
    assert [sample_tokens(logits[r : r + 1], [us[r]], **setting)[0] for r in range(16)] == together


def test_batched_sampler_checks_its_inputs() -> None:
    with pytest.raises(ValueError):
        sample_tokens(torch.zeros(2, 8), [0.5], temperature=1.0, top_p=1.0, top_k=2)
    with pytest.raises(ValueError):
        sample_tokens(torch.zeros(1, 8), [1.0], temperature=1.0, top_p=1.0, top_k=2)
    assert sample_tokens(torch.zeros(0, 8), [], temperature=1.0, top_p=1.0, top_k=2) == []


@pytest.mark.parametrize("vocab", [4096, 4100, 640])  # two stages; 64 segments do not divide; 10 < k
def test_two_stage_top_k_finds_the_one_stage_values(vocab: int) -> None:
    from engine.kernels.top_k import _top_k

    gen = torch.Generator().manual_seed(vocab)
    x = torch.round(torch.randn(9, vocab, generator=gen) * 4) / 4  # ties everywhere
    values, ids = _top_k(x, 20)
    want = torch.topk(x, 20, dim=-1).values
    assert torch.equal(values, want)
    assert torch.equal(x.gather(1, ids), values)  # each id holds its value
    assert all(len(set(row)) == 20 for row in ids.tolist())  # k distinct logits


def test_nan_logits_are_refused() -> None:
    """A NaN logit has no place in the order, so the row's token would mean nothing: the sampler
    says so (the kernel form's twin: tests/engine/kernels/test_kernel_top_k.py)."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    logits[1, [7, 40]] = float("nan")
    with pytest.raises(ValueError, match="row 1 of the logits holds 2 NaN"):
        sample_tokens(logits, [0.5] * 3, temperature=0.6, top_p=0.95, top_k=20)
