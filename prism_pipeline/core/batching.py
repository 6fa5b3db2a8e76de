"""Group events into engine batches by a token budget and a maximum wait.

Pure and clock-free: the caller passes `now` (monotonic seconds), so the rules are testable
without sleeping. Rules:
- items keep their arrival order, across and within batches;
- a batch holds at most `max_tokens` tokens, unless one item alone is larger (it then goes alone,
  since refusing it would stall its partition forever);
- a batch closes when the next item would not fit, when it reaches the budget or `max_items`,
  or when its oldest item has waited `max_wait_s`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


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
