"""Which input events a replay re-decides: a topic range (offsets or times) and/or event ids."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import structlog

from prism_pipeline.offline.errors import ReplayError
from prism_pipeline.offline.kafka_range import Position, end_offsets, stream_ranges, topic_partitions

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Selection:
    """Which input events to replay: a topic range, and/or event ids (found through the records).

    With both, the event ids alone are replayed, and each must lie in the topic's range."""

    topic: str | None = None
    partitions: tuple[int, ...] | None = None  # None: every partition of `topic`
    from_offset: int | None = None  # inclusive; None: the beginning
    to_offset: int | None = None  # exclusive; None: the end (as of the start of the replay)
    from_time: datetime | None = None  # first message with timestamp >= this
    to_time: datetime | None = None  # messages with timestamp < this
    event_ids: tuple[str, ...] = ()

    @property
    def ranged(self) -> bool:
        """Narrowed to part of the topic (partitions, offsets or times)."""
        return any(
            v is not None
            for v in (self.partitions, self.from_offset, self.to_offset, self.from_time, self.to_time)
        )

    def check(self) -> None:
        if self.ranged and self.topic is None:
            raise ReplayError("an offset or time range needs --topic (the input topic)")
        if self.topic is None and not self.event_ids:
            raise ReplayError("nothing selected: give --topic (with an optional range) or --event-id")
        if (self.from_offset is not None or self.to_offset is not None) and (
            self.from_time is not None or self.to_time is not None
        ):
            raise ReplayError("choose an offset range or a time range, not both")
        for name in ("from_time", "to_time"):
            t = getattr(self, name)
            if t is not None and t.tzinfo is None:
                raise ReplayError(f"--{name.replace('_', '-')} needs a timezone (e.g. 2026-11-28T08:00:00Z)")


Bounds = dict[int, tuple[int, int]]  # partition -> (first offset, end offset), end exclusive


async def range_bounds(bootstrap: str, consumer: Any, sel: Selection) -> Bounds:
    """The selected offsets of each selected partition of `sel.topic`, as of now."""
    from aiokafka import TopicPartition

    assert sel.topic is not None
    existing = await topic_partitions(bootstrap, sel.topic)
    parts = list(sel.partitions) if sel.partitions is not None else existing
    unknown = sorted(set(parts) - set(existing))
    if unknown:
        raise ReplayError(f"topic {sel.topic!r} has partitions {existing}, not {unknown}")
    begin, end = await end_offsets(consumer, sel.topic, parts)
    lo = {p: max(begin[p], sel.from_offset or 0) for p in parts}
    hi = {p: end[p] if sel.to_offset is None else min(end[p], sel.to_offset) for p in parts}
    for bound, target in ((sel.from_time, lo), (sel.to_time, hi)):
        if bound is None:
            continue
        ms = int(bound.timestamp() * 1000)
        found = await consumer.offsets_for_times({TopicPartition(sel.topic, p): ms for p in parts})
        for tp, ot in found.items():
            # No message at or after the time: the range runs to (or starts at) the end.
            target[tp.partition] = end[tp.partition] if ot is None else max(begin[tp.partition], ot.offset)
    return {p: (lo[p], hi[p]) for p in parts}


async def range_positions(bootstrap: str, consumer: Any, sel: Selection) -> list[Position]:
    assert sel.topic is not None
    bounds = await range_bounds(bootstrap, consumer, sel)
    return [(sel.topic, p, o) for p, (lo, hi) in bounds.items() for o in range(lo, hi)]


def in_bounds(pos: Position, topic: str, bounds: Bounds) -> bool:
    lo, hi = bounds.get(pos[1], (0, 0))
    return pos[0] == topic and lo <= pos[2] < hi


async def scan_for_ids(
    bootstrap: str, topic: str, bounds: Bounds, ids: set[str]
) -> dict[str, list[Position]]:
    """Where in the range each of `ids` is, read from the input messages themselves.

    Replay finds events by id through their records; an event the worker never recorded (a
    dead-lettered one, or one lost) has none, so before calling a named event absent from the
    topic the range itself is read. Streamed: the range is never held in memory."""
    found: dict[str, list[Position]] = {}
    ranges = [(p, lo, hi) for p, (lo, hi) in sorted(bounds.items())]
    async for _, m in stream_ranges(bootstrap, topic, ranges):
        try:
            obj = orjson.loads(m.value or b"")
        except orjson.JSONDecodeError:
            continue
        eid = obj.get("event_id") if isinstance(obj, dict) else None
        if isinstance(eid, str) and eid in ids:
            found.setdefault(eid, []).append((topic, m.partition, m.offset))
    return found
