"""The vocabulary-mass partials (engine.kernels.vocab_mass) and the device read-out built on them,
against an exactly rounded sum (math.fsum over every entry) and the host read-out."""

from __future__ import annotations

import math

import pytest
import torch

from engine.decide import readout
from engine.decide.readout import (
    DEVICE_READS,
    _device_mass,
    _device_masses,
    _host_mass,
    _letter_index,
    fold_vocab_mass,
    read_letters,
    read_letters_many,
)
from engine.kernels.attached import attach, attached, block_rows
from engine.kernels.vocab_mass import (
    CHUNK,
    FIELDS,
    PassReads,
    ReadsTicket,
    vocab_partials,
    vocab_partials_reference,
    vocab_partials_rows,
)

V = 3 * CHUNK + 1234  # a partial last chunk


def _row(gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    x = torch.randn(V, generator=gen) * 4
    x[CHUNK : 2 * CHUNK] = float("-inf")  # a whole chunk with no mass
    x[17] = 30.0  # one dominant token
    return x.to(dev)


def _exact(x: torch.Tensor) -> tuple[float, float]:
    values = x.double().cpu().tolist()
    m = max(values)
    return m, math.fsum(math.exp(v - m) for v in values)


def test_partials_fold_to_the_exactly_rounded_sum(dev: torch.device, gen: torch.Generator) -> None:
    x = _row(gen, dev)
    parts = vocab_partials(x)
    assert parts.shape == (-(-V // CHUNK), FIELDS) and parts.dtype == torch.float64
    ref = vocab_partials_reference(x)
    assert torch.equal(parts[:, [0, 2, 3]].cpu(), ref[:, [0, 2, 3]])  # max and counts are exact
    torch.testing.assert_close(parts[:, 1].cpu(), ref[:, 1], rtol=1e-13, atol=0)
    m, total = fold_vocab_mass(parts.tolist())
    m_exact, total_exact = _exact(x)
    assert m == m_exact
    assert abs(total - total_exact) <= 1e-14 * total_exact  # fp64 chunk sums, then one fsum


def test_a_row_has_the_same_partials_wherever_it_lies(dev: torch.device, gen: torch.Generator) -> None:
    x = _row(gen, dev)
    block = torch.randn(3, V, generator=gen).to(dev)
    block[1] = x
    assert torch.equal(vocab_partials(block[1]), vocab_partials(x.clone()))


def test_partials_do_not_depend_on_the_order_inside_a_chunk(dev: torch.device, gen: torch.Generator) -> None:
    """The property that makes the address irrelevant: a chunk's sum is the same bits whatever
    order (reduction tree) adds its terms. A shuffled chunk is the strongest version of a
    different tree; an fp64 tree sum fails it, the integer-limb sum passes it on every backend."""
    x = _row(gen, dev)
    shuffled = x.clone()
    for lo in range(0, V, CHUNK):
        hi = min(lo + CHUNK, V)
        perm = torch.randperm(hi - lo, generator=gen).to(dev)
        shuffled[lo:hi] = x[lo:hi][perm]
    assert torch.equal(vocab_partials(shuffled), vocab_partials(x))


def test_nan_and_inf_are_counted_and_refused(dev: torch.device, gen: torch.Generator) -> None:
    x = _row(gen, dev)
    x[[5, CHUNK + 3, V - 1]] = float("nan")
    parts = vocab_partials(x)
    assert parts[:, 2].sum().item() == 3
    with pytest.raises(ValueError, match="3 NaN"):
        fold_vocab_mass(parts.tolist())
    x = _row(gen, dev)
    x[2 * CHUNK + 9] = float("inf")
    with pytest.raises(ValueError, match=r"\+inf"):
        fold_vocab_mass(vocab_partials(x).tolist())


def test_device_mass_matches_the_host_mass(dev: torch.device, gen: torch.Generator) -> None:
    """What `read_letters` folds for a CUDA row against what it sums for a CPU row."""
    x = _row(gen, dev)
    letters = torch.tensor([17, 100, 2 * CHUNK + 5, V - 1])
    m, total, letter_logits = _device_mass(x, x[letters.to(dev)])
    m_host, total_host = _host_mass(x.cpu())
    assert m == m_host and letter_logits == x.cpu()[letters].tolist()
    assert abs(total - total_host) <= 1e-13 * total_host
    host = read_letters(x.cpu(), letters.tolist(), 0.7)
    mass = math.fsum(math.exp(v - m) for v in host.logits)
    assert host.coverage is not None
    assert abs(min(1.0, mass / total) - host.coverage) <= 1e-12 * host.coverage


def test_partials_written_into_a_shared_buffer_are_the_same(dev: torch.device, gen: torch.Generator) -> None:
    x = _row(gen, dev)
    chunks = -(-V // CHUNK)
    buf = torch.full((3 + chunks * FIELDS,), 7.0, dtype=torch.float64, device=dev)
    out = buf[3:].view(chunks, FIELDS)
    assert vocab_partials(x, out=out) is out and torch.equal(out, vocab_partials(x))
    assert torch.equal(buf[:3].cpu(), torch.full((3,), 7.0, dtype=torch.float64))  # nothing else written
    with pytest.raises(ValueError, match="contiguous fp64"):
        vocab_partials(x, out=torch.empty(chunks, FIELDS, device=dev))
    with pytest.raises(ValueError, match="contiguous fp64"):
        vocab_partials(x, out=torch.empty(chunks + 1, FIELDS, dtype=torch.float64, device=dev))


def test_a_block_of_rows_in_one_launch_gives_each_rows_own_partials(
    dev: torch.device, gen: torch.Generator
) -> None:
    """`vocab_partials_rows`: every row of a block (here a column slice of a wider block, so its
    rows lie V + 7 apart) gets the bits `vocab_partials` gives the row alone and contiguous,
    a row of NaN and +inf entries its counts, an empty block nothing; `out` is checked."""
    wide = torch.randn(4, V + 7, generator=gen).to(dev) * 4
    wide[1, :V] = _row(gen, dev)
    wide[2, 5], wide[2, CHUNK + 3], wide[2, 9] = float("nan"), float("inf"), float("-inf")
    block = wide[:, :V]
    parts = vocab_partials_rows(block)
    assert parts.shape == (4, -(-V // CHUNK), FIELDS) and parts.dtype == torch.float64
    for r in range(4):
        assert torch.equal(parts[r], vocab_partials(block[r].clone())), r
    assert parts[2, 0, 2].item() == 1.0 and parts[2, 1, 3].item() == 1.0  # the NaN, the +inf
    out = torch.full_like(parts, 7.0)
    assert vocab_partials_rows(block, out=out) is out and torch.equal(out, parts)
    assert vocab_partials_rows(block[:0]).shape == (0, -(-V // CHUNK), FIELDS)
    with pytest.raises(ValueError, match="contiguous fp64"):
        vocab_partials_rows(block, out=parts[:3])
    with pytest.raises(ValueError, match="2-D"):
        vocab_partials_rows(block[0])


def test_many_rows_fold_to_what_each_row_folds_alone(dev: torch.device, gen: torch.Generator) -> None:
    """`read_letters_many`'s device path: every row's partials and letters in one buffer, one
    copy back; the same numbers as `_device_mass` row by row (rows of one block at other
    alignments, a row of another length, a row with a whole chunk at -inf)."""
    block = torch.randn(3, V, generator=gen).to(dev) * 4
    rows = [_row(gen, dev), block[1], block[2][: 2 * CHUNK + 5], block[0]]
    ids = [[17, 100, 2 * CHUNK + 5, V - 1], [0], [3, 2 * CHUNK + 4], list(range(26))]
    many = _device_masses(rows, ids)
    for x, i, got in zip(rows, ids, many, strict=True):
        index = torch.tensor(i, device=dev)
        assert got == _device_mass(x, x.index_select(0, index))


def test_rows_of_one_block_read_in_one_launch_give_the_same_values(
    dev: torch.device, gen: torch.Generator
) -> None:
    """The "block" form (`_device_masses(block=True)`): rows of one fp32 block, in any order and
    one of them twice, are found as that block's rows and read with one partials launch and a
    pinned copy back, giving the numbers the batched form gives; rows that are not whole rows of
    one contiguous fp32 block fall back to it."""
    block = torch.randn(4, V, generator=gen).to(dev) * 4
    block[2] = _row(gen, dev)
    rows = [block[2], block[0], block[3], block[2]]
    ids = [[17, 100, 2 * CHUNK + 5, V - 1], [0], [3, 2 * CHUNK + 4], list(range(26))]
    found = block_rows(rows)
    assert found is not None and found[0] is block and found[1] == [2, 0, 3, 2]
    assert _device_masses(rows, ids, block=True) == _device_masses(rows, ids)
    other = _row(gen, dev)
    wide = torch.randn(2, V + 3, generator=gen).to(dev)
    for not_one_block in (
        [block[1], other],  # a row of another tensor
        [block[1][: V - 1]],  # part of a row
        [wide[:, :V][0]],  # a row of a block that is not contiguous
        [block.double()[0]],  # not fp32
        [other],  # no block at all
    ):
        assert block_rows(not_one_block) is None
    mixed = [block[1], other]
    assert _device_masses(mixed, ids[:2], block=True) == _device_masses(mixed, ids[:2])


@pytest.mark.parametrize("form", DEVICE_READS)
def test_read_letters_many_reads_the_same_in_every_form(
    dev: torch.device, gen: torch.Generator, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each `DEVICE_READS` form of `read_letters_many` gives `read_letters`' read-outs (on CUDA
    rows the forms run; CPU rows take the host path in all of them)."""
    monkeypatch.setattr(readout, "DEVICE_READ", form)
    block = torch.randn(3, V, generator=gen).to(dev) * 4
    rows = [block[1], block[0], block[2]]
    ids, temps = [[17, 100], [5], list(range(26))], [1.0, 0.5, 2.0]
    many = read_letters_many(rows, ids, temps)
    assert many == [read_letters(r, i, t) for r, i, t in zip(rows, ids, temps, strict=True)]


def test_rows_of_other_float_types_read_the_same_values(dev: torch.device, gen: torch.Generator) -> None:
    """A batch with a row that is not fp32 takes the fp64 letter buffer (fp32 rows' letters go
    into an fp32 tail otherwise): the same numbers as row by row either way, and a letter list
    read again uses the index kept on the device (`_letter_index`), not a new upload."""
    block = torch.randn(2, V, generator=gen).to(dev) * 4
    rows = [block[0].to(torch.bfloat16), block[1], _row(gen, dev).double()]
    ids = [[5, 2 * CHUNK + 1], [17, 100], [V - 1, 0, 3]]
    many = _device_masses(rows, ids)
    for x, i, got in zip(rows, ids, many, strict=True):
        assert got == _device_mass(x, x.index_select(0, torch.tensor(i, device=dev)))
    assert _device_masses(rows[1:2], ids[1:2]) == many[1:2]  # fp32 alone: the fp32 tail
    assert _letter_index([17, 100], block.device) is _letter_index((17, 100), block.device)
    assert _letter_index([17, 100], block.device).tolist() == [17, 100]


def test_a_pass_reads_numbers_are_each_rows_partials_and_letters(
    dev: torch.device, gen: torch.Generator
) -> None:
    """`PassReads` (what a graphed pass makes beside its logits): each row's numbers are its own
    `vocab_partials` and its logits at the asked ids, in the asked order; a later launch makes an
    earlier ticket give nothing, as do ids it did not gather and rows outside the block."""
    letters = [33, 17, V - 1, 2 * CHUNK + 4, 0]
    reads = PassReads(4, V, letters, dev)
    block = torch.randn(4, V, generator=gen).to(dev) * 4
    block[1] = _row(gen, dev)
    reads.compute(block)
    ticket = reads.issue()
    ids = [[17, 33], [V - 1, 0, 2 * CHUNK + 4], [0]]
    got = ticket.values([1, 3, 1], ids)
    assert got is not None
    for (parts, values), r, i in zip(got, [1, 3, 1], ids, strict=True):
        assert parts == vocab_partials(block[r]).flatten().tolist()
        assert values == block[r, i].tolist()
    assert ticket.values([1], [[18]]) is None  # not gathered
    assert ticket.values([4], [[17]]) is None  # no such row
    reads.compute(block.flip(0))  # the next launch: row 2 is the first launch's row 1
    later = reads.issue()
    assert ticket.values([1], [[17, 33]]) is None
    assert later.values([2], [[17, 33]]) == got[:1]
    for bad in ((0, V, letters), (2, V, []), (2, V, [1, 1]), (2, V, [V])):
        with pytest.raises(ValueError):
            PassReads(bad[0], bad[1], bad[2], dev)


def test_rows_of_a_block_with_its_pass_numbers_read_them_and_launch_nothing(
    dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_device_masses` of rows of a block its pass attached numbers to folds those numbers (no
    partials kernel runs: it is made to fail) into what the batched form gives the same rows;
    after a later launch of that pass, or for ids it did not gather, it runs the kernels again."""
    block = torch.randn(3, V, generator=gen).to(dev) * 4
    block[0] = _row(gen, dev)
    plain = block.clone()
    rows, ids = [block[2], block[0]], [[17, 100], list(range(26))]
    want = _device_masses([plain[2], plain[0]], ids)
    reads = PassReads(3, V, range(120), dev)
    reads.compute(block)
    attach(block, reads.issue())
    assert attached(block, ReadsTicket) is not None and attached(plain, ReadsTicket) is None

    def no_kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("a read-out with its pass's numbers launched the partials kernel")

    with monkeypatch.context() as patch:
        patch.setattr("engine.kernels.vocab_mass.vocab_partials", no_kernel)
        patch.setattr("engine.kernels.vocab_mass.vocab_partials_rows", no_kernel)
        assert _device_masses(rows, ids) == want
        assert _device_masses(rows, ids, block=True) == want
    assert _device_masses(rows, [[17, 200], [5]]) == _device_masses([plain[2], plain[0]], [[17, 200], [5]])
    reads.compute(torch.zeros_like(block))  # a later launch of the pass overwrote the numbers
    reads.issue()
    assert _device_masses(rows, ids) == want
