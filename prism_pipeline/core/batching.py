"""Group events into engine batches: by a token budget and a maximum wait (`Batcher`: the worker
and the HTTP server; `pack`: offline jobs), or as the records say they were (`recorded_batches`:
replay and the demo's verify).

Pure and clock-free: the caller passes `now` (monotonic seconds), so the rules are testable
without sleeping. Rules:
- items keep their arrival order, across and within batches;
- a batch holds at most `max_tokens` tokens, unless one item alone is larger (it then goes alone,
  since refusing it would stall its partition forever);
- a batch closes when the next item would not fit, when it reaches the budget or `max_items`,
  or when its oldest item has waited `max_wait_s`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


@dataclass
class Batch(Generic[T]):
    items: list[T] = field(default_factory=list)
    tokens: int = 0
    opened_at: float = 0.0


class Batcher(Generic[T]):
    def __init__(self, max_tokens: int, max_wait_s: float, max_items: int | None = None) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if max_items is not None and max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.max_tokens = max_tokens
        self.max_wait_s = max_wait_s
        self.max_items = max_items
        self._open: Batch[T] | None = None

    def add(self, item: T, tokens: int, now: float) -> list[Batch[T]]:
        """Add one item; returns the batches this closed (zero, one or two), oldest first."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        closed: list[Batch[T]] = []
        if self._open is not None and self._open.tokens + tokens > self.max_tokens:
            closed.append(self._open)
            self._open = None
        if self._open is None:
            self._open = Batch(opened_at=now)
        self._open.items.append(item)
        self._open.tokens += tokens
        full_tokens = self._open.tokens >= self.max_tokens
        full_items = self.max_items is not None and len(self._open.items) >= self.max_items
        if full_tokens or full_items:
            closed.append(self._open)
            self._open = None
        return closed

    def deadline(self) -> float | None:
        """When the open batch must be dispatched (None when nothing is waiting)."""
        return None if self._open is None else self._open.opened_at + self.max_wait_s

    def due(self, now: float) -> Batch[T] | None:
        """Close and return the open batch if its oldest item has waited long enough."""
        deadline = self.deadline()
        if deadline is None or now < deadline:
            return None
        return self.flush()

    def flush(self) -> Batch[T] | None:
        """Close the open batch now (shutdown, rebalance)."""
        batch, self._open = self._open, None
        return batch

    @property
    def pending_items(self) -> int:
        return 0 if self._open is None else len(self._open.items)


def pack(items: Iterable[tuple[T, int]], max_tokens: int, max_items: int | None = None) -> list[list[T]]:
    """`items` (each with its token count) cut into consecutive batches by the same rules, with no
    clock: offline jobs (backfill) pack for throughput and never wait."""
    batcher: Batcher[T] = Batcher(max_tokens, 0.0, max_items)
    out = [b.items for item, tokens in items for b in batcher.add(item, tokens, 0.0)]
    last = batcher.flush()
    if last is not None:
        out.append(last.items)
    return out


def recorded_batches(
    keys: Sequence[K],
    label_of: Callable[[K], str | None],
    members_of: Callable[[str], list[K]],
    invariant: Callable[[K], bool],
    free_size: int = 64,
) -> list[list[K]]:
    """The engine calls that re-decide recorded events: where a record was decided matters, its batch.

    `label_of` names the engine call a key's record says decided it (the `prism-batch` header),
    `members_of` every key of that call in batch order. On a batch-invariant path (`invariant`:
    int8) any grouping reproduces a record, so those keys go `free_size` a call; on a reference path
    (fp32/bf16) a recorded batch is re-formed whole, batch-mates included, and a key with no label
    is decided alone (what a worker with one event a batch would have done).
    """
    groups: list[list[K]] = []
    seen: set[K] = set()
    loose: list[K] = []
    for key in keys:
        if key in seen:
            continue
        label = label_of(key)
        if label is None or invariant(key):
            loose.append(key)
            seen.add(key)
            continue
        members = members_of(label)
        seen.update(members)
        groups.append(members)
    free = [k for k in loose if invariant(k)]
    for i in range(0, len(free), free_size):
        groups.append(free[i : i + free_size])
    groups.extend([k] for k in loose if not invariant(k))
    return groups
