"""What a graphed pass made beside the block it returns, found again from the block's rows.

A captured pass can end with a few more nodes that turn its output (a logits block) into the small
numbers a later step needs, copied into pinned host memory with the pass: the read-outs' partials
and letters (`engine.kernels.vocab_mass.PassReads`), the sampler's top-k candidates
(`engine.decide.sampling.StepTopK`). After each launch the pass attaches its ticket to the block
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


def row_of(row: torch.Tensor, block: torch.Tensor) -> int | None:
    """The index of `row` in `block` where it is a whole row of it (a view `block[i]` of a
    contiguous 2-D block that is a tensor of its own, not a view: a view's rows name its base),
    else None."""
    if row._base is not block or block.dim() != 2 or not block.is_contiguous():
        return None
    width = block.shape[1]
    at = row.storage_offset() - block.storage_offset()
    if row.dim() != 1 or row.numel() != width or row.stride(0) != 1 or at % width:
        return None
    return at // width


def block_rows(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """(block, each row's index in it) where every row is a whole row of one contiguous 2-D fp32
    tensor (the views a pass's logits give), else None."""
    block = rows[0]._base if rows else None
    if block is None or block.dtype != torch.float32:
        return None
    index = [row_of(x, block) for x in rows]
    if any(i is None for i in index):
        return None
    return block, index  # type: ignore[return-value]
