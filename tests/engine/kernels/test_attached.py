"""`engine.kernels.attached`: tickets found again from a block and its rows, one per type, gone
with the block."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

import engine.kernels.attached as attached_module
from engine.kernels.attached import attach, attached, block_rows, rows_in


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
    assert rows_in(block, [block[2], block[0], block[3]]) == [2, 0, 3]
    assert rows_in(block, [block[1][:5], block[:, 1], torch.zeros(6)]) == [
        None,
        None,
        None,
    ]  # part, column, other
    wide = torch.zeros(4, 7)
    assert rows_in(wide[:, :6], [wide[:, :6][1]]) == [None]  # a view (not contiguous) is no block
    assert rows_in(block.view(2, 12), [block.view(2, 12)[1]]) == [None]  # nor is any other view
    assert block_rows([block[3], block[1], block[3]]) == (block, [3, 1, 3])
    assert block_rows([block[3], torch.zeros(6)]) is None
    assert block_rows([block.double()[0]]) is None  # not fp32
    assert block_rows([]) is None
