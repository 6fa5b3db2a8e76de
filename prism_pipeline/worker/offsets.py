"""Per-partition commit point: the first offset whose outcome is not yet acknowledged.

Kafka commits one number per partition, meaning "everything below this is done". Outcomes
(decision records, dead letters) are acknowledged out of order, because invalid events skip
the engine and batches finish at different times. The tracker therefore remembers every
offset it handed out, in order, and only moves the commit point over a contiguous acked run.
Offsets may have gaps (transaction markers, compaction): only offsets that were tracked count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator


class OffsetTracker:
    """Contiguous-acked watermark of one partition.

    `committable` is the offset to commit (Kafka's "next offset to read"): the first tracked
    offset that is not acked, or one past the last tracked offset when all are acked.
    """

    def __init__(self) -> None:
        self._order: deque[int] = deque()  # tracked and not yet behind the watermark, increasing
        self._unacked: set[int] = set()
        self._last_tracked: int | None = None
        self._committable: int | None = None

    def track(self, offset: int) -> None:
        """Register a consumed offset; offsets must arrive strictly increasing."""
        if self._last_tracked is not None and offset <= self._last_tracked:
            raise ValueError(f"offset {offset} tracked after {self._last_tracked}: offsets must increase")
        self._last_tracked = offset
        self._order.append(offset)
        self._unacked.add(offset)
        # The front of `_order` is always un-acked; if this offset is the front, nothing older
        # is outstanding and the commit point now waits on it.
        self._committable = self._order[0]

    def ack(self, offset: int) -> bool:
        """Mark an offset's outcome acknowledged; returns whether the commit point moved."""
        if offset not in self._unacked:
            raise KeyError(f"offset {offset} is not pending")
        self._unacked.discard(offset)
        moved = False
        while self._order and self._order[0] not in self._unacked:
            self._order.popleft()
            moved = True
        if moved:
            assert self._last_tracked is not None
            self._committable = self._order[0] if self._order else self._last_tracked + 1
        return moved

    @property
    def committable(self) -> int | None:
        """The offset to commit now (None before the first tracked offset)."""
        return self._committable

    @property
    def in_flight(self) -> int:
        """Tracked offsets whose outcome is not acknowledged yet."""
        return len(self._unacked)

    def is_pending(self, offset: int) -> bool:
        return offset in self._unacked

    def pending_in_order(self) -> Iterator[int]:
        """Un-acked offsets, oldest first (the exactly-once path publishes them in this order)."""
        return (o for o in self._order if o in self._unacked)
