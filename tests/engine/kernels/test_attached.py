"""`engine.kernels.attached`: tickets found again from a block and its rows, one per type, gone
with the block."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

import engine.kernels.attached as attached_module
from engine.kernels.attached import attach, attached, block_rows, row_of


@dataclass(frozen=True)
class _Reads:
    n: int


@dataclass(frozen=True)
class _TopK:
    n: int


def test_a_block_keeps_one_ticket_of_each_type_while_it_lives() -> None:
    block = torch.zeros(3, 8)
    plain = torch.zeros(3, 8)
    attach(block, _Reads(1))
    attach(block, _TopK(1))
    attach(block, _Reads(2))  # replaces the first of its type
    assert attached(block, _Reads) == _Reads(2) and attached(block, _TopK) == _TopK(1)
    assert attached(plain, _Reads) is None and attached(block, str) is None
    key = id(block)
    del block
    gc.collect()
    assert (
        key not in attached_module._ATTACHED
    )  # dropped with the block: a new tensor at its id inherits nothing


def test_rows_are_found_in_their_block() -> None:
    block = torch.arange(24.0).view(4, 6).clone()  # a tensor of its own, as a pass returns its logits
    assert [row_of(block[i], block) for i in (2, 0, 3)] == [2, 0, 3]
    assert row_of(block[1][:5], block) is None  # part of a row
    assert row_of(block[:, 1], block) is None  # a column
    assert row_of(torch.zeros(6), block) is None  # another tensor
    wide = torch.zeros(4, 7)
    assert row_of(wide[:, :6][1], wide[:, :6]) is None  # a view (not contiguous) is no block
    assert row_of(block.view(2, 12)[1], block.view(2, 12)) is None  # nor is any other view
    assert block_rows([block[3], block[1], block[3]]) == (block, [3, 1, 3])
    assert block_rows([block[3], torch.zeros(6)]) is None
    assert block_rows([block.double()[0]]) is None  # not fp32
    assert block_rows([]) is None
