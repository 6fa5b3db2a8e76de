"""The rows' top-k kernels (engine.kernels.top_k) against an independent oracle, and the sampler's
kernel form against its torch form.

The oracle is a stable descending sort of each row's non-NaN logits (`torch.argsort(-x,
stable=True)`: lowest id first among equal values), `torch.topk`'s values, and the count at the
cut by direct comparison. The interpreter cases use small vocabularies and chunks (it runs every
round of every program in Python); the CUDA cases run the 27B's vocabulary with the default chunk.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.decide import sampling
from engine.kernels import top_k as top_k_kernels
from engine.kernels.top_k import CHUNK, EMPTY, fits, row_top_k, row_top_k_reference, unpack

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B vocabulary runs compiled, on CUDA")


def _rows(n: int, vocab: int, gen: torch.Generator, chunk: int) -> torch.Tensor:
    """Random logits with the awkward rows first: heavy ties (also across chunk boundaries and
    straddling the cut), all -inf, +inf entries, signed zeros, a short tail chunk."""
    x = torch.randn(n, vocab, generator=gen) * 3
    awkward = [
        torch.randint(0, 4, (vocab,), generator=gen).float(),  # ties everywhere, every chunk
        torch.full((vocab,), float("-inf")),  # no finite logit at all
        torch.where(torch.rand(vocab, generator=gen) < 0.05, float("inf"), float("-inf")),
        torch.where(torch.rand(vocab, generator=gen) < 0.5, 0.0, -0.0),  # the zeros tie
    ]
    for r, row in enumerate(awkward[:n]):
        x[r] = row
    if n > 4:  # a tie straddling the cut, its members on both sides of a chunk boundary
        x[4] = torch.round(x[4])
        top = float(x[4].max()) + 1.0
        x[4, [chunk - 2, chunk - 1, chunk, chunk + 1, vocab - 1]] = top
        x[4, [3, 5 + chunk, vocab // 2]] = top + 1.0
    if n > 5:
        x[5, -1] = 40.0  # the largest in the short last chunk
        x[5, 0] = float("inf")
    return x


def _oracle(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """values, ids, reach, NaN count per row, from a stable sort of the row's non-NaN logits."""
    values, ids, reach, nan = [], [], [], []
    for row in x.cpu():
        keep = (~torch.isnan(row)).nonzero()[:, 0]
        sub = row[keep]
        order = torch.argsort(-sub, stable=True)[:k]
        assert torch.equal(sub[order], torch.topk(sub, k).values)  # the values are topk's
        values.append(sub[order])
        ids.append(keep[order])
        reach.append(int((sub >= sub[order][-1]).sum()))
        nan.append(row.numel() - keep.numel())
    return torch.stack(values), torch.stack(ids), torch.tensor(reach), torch.tensor(nan)


def _check(x: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    packed = row_top_k(x, k, backend="triton", chunk=chunk)
    got = unpack(packed.cpu(), k)
    values, ids, reach, nan = _oracle(x, k)
    assert torch.equal(got.ids, ids)
    assert torch.equal(got.values.view(torch.int32), values.view(torch.int32))  # bits: zeros' signs too
    assert torch.equal(got.reach, reach)
    assert torch.equal(got.nan, nan)
    assert torch.equal(packed.cpu(), row_top_k_reference(x.cpu(), k))  # the torch form, the same bits
    return packed


@pytest.mark.parametrize(
    ("k", "vocab", "chunk"),
    [
        (20, 1000, 64),  # 16 chunks, the last one short
        (1, 1000, 128),
        (64, 300, 64),  # k = chunk: a chunk's every lane is a candidate
        (20, 50, 64),  # the vocabulary shorter than one chunk
        (20, 512, 128),  # chunks dividing the vocabulary
    ],
)
def test_rows_match_the_stable_sort(
    k: int, vocab: int, chunk: int, dev: torch.device, gen: torch.Generator
) -> None:
    x = _rows(6, vocab, gen, min(chunk, vocab // 2))
    _check(x.to(dev), k, chunk)


def test_nan_is_counted_and_left_out(dev: torch.device, gen: torch.Generator) -> None:
    """NaN lanes (also at chunk boundaries and in the last chunk) are counted and never selected;
    a row with fewer than k other logits gets id -1, a -inf value and reach = those logits."""
    vocab, chunk, k = 300, 64, 20
    x = _rows(3, vocab, gen, chunk)
    x[0, [0, 63, 64, 299]] = float("nan")
    x[1, :] = float("nan")
    x[1, [10, 200]] = torch.tensor([-1.0, float("-inf")])
    x[2, ::2] = float("nan")
    got = unpack(row_top_k(x.to(dev), k, backend="triton", chunk=chunk).cpu(), k)
    assert got.nan.tolist() == [4, vocab - 2, vocab // 2]
    values, ids, reach, _ = _oracle(x[[0, 2]], k)
    assert torch.equal(got.ids[[0, 2]], ids) and torch.equal(got.values[[0, 2]], values)
    assert torch.equal(got.reach[[0, 2]], reach)
    assert got.ids[1].tolist() == [10, 200] + [-1] * (k - 2)
    assert got.values[1].tolist() == [-1.0] + [float("-inf")] * (k - 1)
    assert got.reach[1].item() == 2
    assert torch.equal(
        row_top_k(x.to(dev), k, backend="triton", chunk=chunk).cpu(), row_top_k_reference(x, k)
    )


def test_a_row_gives_the_same_bits_alone_and_in_a_batch(dev: torch.device, gen: torch.Generator) -> None:
    vocab, chunk, k = 700, 128, 20
    block = _rows(6, vocab, gen, chunk).to(dev)
    together = row_top_k(block, k, backend="triton", chunk=chunk)
    wide = torch.zeros(6, vocab + 37, device=dev)
    wide[:, 5 : 5 + vocab] = block  # rows inside a wider buffer: a row stride that is not the vocabulary
    assert torch.equal(row_top_k(wide[:, 5 : 5 + vocab], k, backend="triton", chunk=chunk), together)
    for r in (0, 4, 5):
        assert torch.equal(
            row_top_k(block[r : r + 1].clone(), k, backend="triton", chunk=chunk), together[r : r + 1]
        )
    assert row_top_k(block[:0], k, backend="triton", chunk=chunk).shape == (0, 2 * k + 2)


def test_every_chunk_gives_the_same_output(dev: torch.device, gen: torch.Generator) -> None:
    x = _rows(4, 300, gen, 64).to(dev)
    want = row_top_k(x, 16, backend="triton", chunk=16)  # 19 chunks, the last of 12 lanes
    for chunk in (64, 512):
        assert torch.equal(row_top_k(x, 16, backend="triton", chunk=chunk), want)


def test_shapes_it_does_not_take_are_refused() -> None:
    x = torch.zeros(2, 100)
    for k, chunk in ((0, 64), (101, 128), (65, 64), (8, 48)):
        assert not fits(100, k, chunk)
        with pytest.raises(ValueError, match="row_top_k takes"):
            row_top_k(x, k, backend="torch", chunk=chunk)
    assert not fits(248_320, 128)  # 64 chunk slots x 128: past MERGE_MAX
    assert fits(248_320, 20) and fits(248_320, 64) and fits(100, 100, 128)
    with pytest.raises(ValueError, match="fp32"):
        row_top_k(x.double(), 4, backend="torch")
    assert EMPTY >> 32 == -(2**31)  # below every real value's key


@CUDA
def test_the_27b_vocabulary_on_cuda(gen: torch.Generator) -> None:
    """The decoder's shape: 64 rows of 248,320 logits, k = 20, the default chunk (61 chunks)."""
    vocab = 248_320
    x = _rows(64, vocab, gen, CHUNK)
    x[6] = torch.round(x[6] * 4) / 4  # ties at the cut
    x[7, [5, 70_000, vocab - 1]] = float("nan")
    _check(x.cuda(), 20, CHUNK)
    packed = row_top_k(x.cuda(), 20)
    assert torch.equal(row_top_k(x[6:7].cuda(), 20), packed[6:7])


@CUDA
def test_k_64_on_cuda(gen: torch.Generator) -> None:
    x = _rows(8, 248_320, gen, CHUNK)
    _check(x.cuda(), 64, CHUNK)


# ---- the sampler: its kernel form against its torch form ----

SAMPLE_VOCAB, SAMPLE_CHUNK = 1000, 128


def _sample_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, SAMPLE_VOCAB, generator=gen) * 3
    for r in range(0, n, 3):
        x[r] = torch.round(x[r])  # many ties, often across the 20th place
    x[1, :40] = x[1].max()  # 40 tied maxima: the cut falls inside the tie
    x[2, [SAMPLE_CHUNK - 1, SAMPLE_CHUNK, 3 * SAMPLE_CHUNK]] = x[2].max() + 0.5  # ties across chunks
    x[4, :] = float("-inf")
    x[4, [5, 900, 17]] = torch.tensor([1.0, 1.0, -2.0])
    return x


@pytest.fixture
def kernel_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's kernel form, run through the interpreter on CPU, with a small chunk."""
    monkeypatch.setattr(top_k_kernels, "TOP_K_FORM", "kernel")
    monkeypatch.setattr(top_k_kernels, "_TOP_K_BACKEND", "triton")
    monkeypatch.setattr(top_k_kernels, "CHUNK", SAMPLE_CHUNK)


@pytest.mark.parametrize(
    "setting", [dict(temperature=0.6, top_p=0.95, top_k=20), dict(temperature=1.3, top_p=1.0, top_k=5)]
)
def test_the_kernel_form_draws_the_torch_forms_tokens(
    setting: dict, dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over rows with ties inside, at and across the cut (also across chunks), and uniforms at
    the ends of [0, 1): the same tokens as the torch form and as `sample_token` row by row."""
    n = 18
    logits = _sample_rows(n, gen).to(dev)
    rng = random.Random(9)
    us = [rng.random() for _ in range(n)]
    us[3], us[5] = 0.0, 1.0 - 2.0**-53
    want = sampling.sample_tokens(logits, us, **setting)
    assert want == [sampling.sample_token(logits[r], u, **setting) for r, u in enumerate(us)]
    monkeypatch.setattr(top_k_kernels, "TOP_K_FORM", "kernel")
    monkeypatch.setattr(top_k_kernels, "_TOP_K_BACKEND", "triton")
    monkeypatch.setattr(top_k_kernels, "CHUNK", SAMPLE_CHUNK)
    calls: list[int] = []
    real = top_k_kernels.row_top_k
    monkeypatch.setattr(top_k_kernels, "row_top_k", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert sampling.sample_tokens(logits, us, **setting) == want
    assert calls  # the kernel form ran


@pytest.mark.parametrize("form", top_k_kernels.TOP_K_FORMS)
def test_nan_logits_are_refused_in_both_forms(
    form: str, dev: torch.device, gen: torch.Generator, kernel_form: None
) -> None:
    top_k_kernels.TOP_K_FORM = form  # the fixture's monkeypatch restores it
    logits = _sample_rows(5, gen).to(dev)
    logits[2, 700] = float("nan")
    with pytest.raises(ValueError, match=r"row 2 of the logits holds 1 NaN"):
        sampling.sample_tokens(logits, [0.5] * 5, temperature=0.6, top_p=0.95, top_k=20)


def test_a_step_top_k_gives_the_packed_rows_of_its_launch_until_the_next(
    dev: torch.device, gen: torch.Generator
) -> None:
    """`StepTopK`: what `compute` made, read back through the launch's ticket, equals
    `packed_top_k` of the same logits (ties at the cut included); a later launch makes the earlier
    ticket give nothing, and the sampler finds the rows of a block that carries a ticket."""
    from engine.kernels.attached import attach

    logits = _sample_rows(6, gen).to(dev)
    step = top_k_kernels.StepTopK(8, 20, logits.device)
    step.compute(logits)
    first = step.issue()
    want = top_k_kernels.packed_top_k(logits, 20).cpu()
    got = first.rows()
    assert got is not None and torch.equal(got[:6], want)
    block = logits.clone()
    attach(block, first)
    table, missing = top_k_kernels.step_top_k_rows([block[4], block[1], logits[1]], 20)
    assert table is not None and missing == [2]
    assert torch.equal(table[0], want[4]) and torch.equal(table[1], want[1]) and not table[2].any()
    in_order, none = top_k_kernels.step_top_k_rows(list(block), 20)  # the whole step: its own rows
    assert none == [] and in_order is not None and torch.equal(in_order, want)
    assert top_k_kernels.step_top_k_rows([block[4]], 19) == (None, [0])  # made for another k
    assert top_k_kernels.step_top_k_rows([block[1][:5]], 20) == (None, [0])  # not a whole row
    step.compute(logits.flip(0))
    second = step.issue()
    assert first.rows() is None and top_k_kernels.step_top_k_rows([block[4]], 20) == (None, [0])
    again = second.rows()
    assert again is not None and torch.equal(again[:6], want.flip(0))
    with pytest.raises(ValueError, match="rows >= 1"):
        top_k_kernels.StepTopK(0, 20, logits.device)
