"""The decision records already on a decisions topic, indexed by the input position each names,
by event id and by the engine call (`prism-batch` header) that decided it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog

from prism_pipeline.offline.kafka_range import (
    Position,
    end_offsets,
    range_consumer,
    read_ranges,
    topic_partitions,
)

log = structlog.get_logger(__name__)


@dataclass
class RecordedCopy:
    """One decision record message as found on the decisions topic."""

    value: bytes
    event_id: str | None
    model: dict[str, Any] | None  # the record's provenance, as plain JSON
    batch: str | None
    batch_pos: int
    where: tuple[int, int]  # (partition, offset) on the decisions topic


@dataclass
class RecordIndex:
    by_input: dict[Position, list[RecordedCopy]] = field(default_factory=lambda: defaultdict(list))
    by_event: dict[str, list[Position]] = field(default_factory=lambda: defaultdict(list))
    by_batch: dict[str, list[tuple[int, Position]]] = field(default_factory=lambda: defaultdict(list))
    unreadable: int = 0  # messages that are not JSON objects with an input position

    def add(self, value: bytes, headers: Iterable[tuple[str, bytes]], where: tuple[int, int]) -> None:
        try:
            obj = orjson.loads(value)
            ref = obj["input"]
            pos: Position = (str(ref["topic"]), int(ref["partition"]), int(ref["offset"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            self.unreadable += 1
            return
        h = dict(headers)
        batch = h.get("prism-batch")
        try:
            batch_pos = int(h.get("prism-batch-pos", b"0"))
        except ValueError:
            batch_pos = 0
        event_id = obj.get("event_id") if isinstance(obj.get("event_id"), str) else None
        model = obj.get("model") if isinstance(obj.get("model"), dict) else None
        copies = self.by_input[pos]
        copy = RecordedCopy(value, event_id, model, batch.decode() if batch else None, batch_pos, where)
        copies.append(copy)
        if len(copies) == 1:
            if event_id is not None:
                self.by_event[event_id].append(pos)
            if copy.batch is not None:
                self.by_batch[copy.batch].append((batch_pos, pos))


async def read_records(bootstrap: str, topic: str) -> RecordIndex:
    """Index every decision record on `topic`, as of now, by input position, event id and batch."""
    consumer = range_consumer(bootstrap)
    await consumer.start()
    try:
        parts = await topic_partitions(bootstrap, topic)
        begin, end = await end_offsets(consumer, topic, parts)
        msgs = await read_ranges(consumer, {(topic, p): (begin[p], end[p]) for p in parts})
    finally:
        await consumer.stop()
    index = RecordIndex()
    for m in sorted(msgs, key=lambda m: (m.partition, m.offset)):
        if m.value is not None:
            index.add(m.value, m.headers or (), (m.partition, m.offset))
    return index
