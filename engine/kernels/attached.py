"""What a graphed pass made beside the block it returns, found again from the block's rows.

A captured pass can end with a few more nodes that turn its output (a logits block) into the small
numbers a later step needs, copied into pinned host memory with the pass: the read-outs' partials
and letters (`engine.kernels.vocab_mass.PassReads`), the sampler's top-k candidates
(`engine.kernels.top_k.StepTopK`). After each launch the pass attaches its ticket to the block
it returns; the rows then travel through the engine as plain views of the block (`block[i]`), and
whoever consumes them finds the block and the ticket again here, instead of launching kernels
after the pass. A ticket knows whether a later launch overwrote its numbers.

Keyed by the block's id, checked by identity, dropped when the block dies; one ticket of each
type per block.

May import: torch only.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_ATTACHED: dict[int, tuple[weakref.ref[torch.Tensor], dict[type, Any]]] = {}


def attach(block: torch.Tensor, ticket: object) -> None:
    """Let consumers of `block`'s rows take `ticket`'s numbers (replacing a ticket of its type)."""
    key = id(block)
    found = _ATTACHED.get(key)
    if found is None or found[0]() is not block:
        found = (weakref.ref(block, lambda _, key=key: _ATTACHED.pop(key, None)), {})
        _ATTACHED[key] = found
    found[1][type(ticket)] = ticket


def attached(block: torch.Tensor, kind: type[T]) -> T | None:
    """The ticket of type `kind` that `attach` gave `block`, or None."""
    found = _ATTACHED.get(id(block))
    if found is None or found[0]() is not block:
        return None
    return found[1].get(kind)


def rows_in(block: torch.Tensor, rows: Sequence[torch.Tensor]) -> list[int | None]:
    """Per row, its index in `block` where it is a whole row of it (a view `block[i]`), else None;
    all None unless `block` is a contiguous 2-D tensor of its own (a view's rows name its base).
    The block is checked once, each row with a few attribute reads (a sampler calls this for
    every row of every decode step)."""
    if block.dim() != 2 or not block.is_contiguous():
        return [None] * len(rows)
    width, lo = block.shape[1], block.storage_offset()
    found: list[int | None] = []
    for x in rows:
        at = x.storage_offset() - lo
        whole = x._base is block and x.shape == (width,) and x.stride() == (1,) and at % width == 0
        found.append(at // width if whole else None)
    return found


def attached_rows(rows: Sequence[torch.Tensor], kind: type[T]) -> list[tuple[T, list[int], list[int]]]:
    """Where `rows` are whole rows of blocks carrying a ticket of type `kind`: per such block, (its
    ticket, the positions in `rows` of its rows, those rows' indices in the block). Rows are
    grouped by the block they are views of, so the common case - every row a row of one pass's
    output - costs a few attribute reads a row."""
    groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for r, x in enumerate(rows):
        block = x._base
        if block is not None:
            groups.setdefault(id(block), (block, []))[1].append(r)
    found = []
    for block, members in groups.values():
        ticket = attached(block, kind)
        if ticket is None:
            continue
        index = rows_in(block, [rows[r] for r in members])
        where = [r for r, i in zip(members, index, strict=True) if i is not None]
        found.append((ticket, where, [i for i in index if i is not None]))
    return found


def block_rows(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """(block, each row's index in it) where every row is a whole row of one contiguous 2-D fp32
    tensor (the views a pass's logits give), else None."""
    block = rows[0]._base if rows else None
    if block is None or block.dtype != torch.float32:
        return None
    index = rows_in(block, rows)
    if any(i is None for i in index):
        return None
    return block, index  # type: ignore[return-value]
