"""Kafka range reads, in one place: a topic's partitions, its offset bounds, every message of a
fixed offset range, and a stream of one partition's range (backfill's topic input).

Every read is `read_committed`, so aborted transactions (exactly-once workers) are never read as
records or events; consumers here have no group and commit nothing.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import structlog

from prism_pipeline.offline.errors import OfflineError

log = structlog.get_logger(__name__)


Position = tuple[str, int, int]  # (topic, partition, offset)
_IDLE_TIMEOUT_S = 30.0  # a partition that stops delivering below its end offset for this long


def range_consumer(bootstrap: str) -> Any:
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",  # aborted transactions (exactly-once mode) are not records
        auto_offset_reset="earliest",
    )


async def topic_partitions(bootstrap: str, topic: str) -> list[int]:
    """The partition ids of `topic` (raises OfflineError when it does not exist)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (meta,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    parts = sorted(p["partition"] for p in meta.get("partitions", ()))
    if meta.get("error_code") or not parts:
        raise OfflineError(f"topic {topic!r} does not exist (or has no partitions)")
    return parts


async def read_ranges(consumer: Any, ranges: dict[tuple[str, int], tuple[int, int]]) -> list[Any]:
    """Every message with start <= offset < end of each (topic, partition)."""
    from aiokafka import TopicPartition

    wanted = {TopicPartition(t, p): r for (t, p), r in ranges.items() if r[0] < r[1]}
    if not wanted:
        return []
    consumer.assign(list(wanted))
    for tp, (start, _) in wanted.items():
        consumer.seek(tp, start)
    out: list[Any] = []
    open_tps = set(wanted)
    last_progress = time.monotonic()
    while open_tps:
        got = await consumer.getmany(*open_tps, timeout_ms=200)
        for tp, msgs in got.items():
            start, end = wanted[tp]
            out.extend(m for m in msgs if start <= m.offset < end)
            last_progress = time.monotonic()
        for tp in list(open_tps):
            if await consumer.position(tp) >= wanted[tp][1]:
                open_tps.discard(tp)
        if open_tps and time.monotonic() - last_progress > _IDLE_TIMEOUT_S:
            log.warning(
                "replay.read_stalled",
                partitions={f"{tp.topic}/{tp.partition}": wanted[tp] for tp in open_tps},
            )
            break
    return out


async def end_offsets(
    consumer: Any, topic: str, parts: Sequence[int]
) -> tuple[dict[int, int], dict[int, int]]:
    from aiokafka import TopicPartition

    tps = [TopicPartition(topic, p) for p in parts]
    begin = await consumer.beginning_offsets(tps)
    end = await consumer.end_offsets(tps)
    return {tp.partition: o for tp, o in begin.items()}, {tp.partition: o for tp, o in end.items()}


async def fetch_positions(consumer: Any, positions: Iterable[Position]) -> dict[Position, bytes]:
    spans: dict[tuple[str, int], list[int]] = defaultdict(list)
    for t, p, o in positions:
        spans[(t, p)].append(o)
    ranges = {tp: (min(offs), max(offs) + 1) for tp, offs in spans.items()}
    wanted = set(positions)
    out: dict[Position, bytes] = {}
    for m in await read_ranges(consumer, ranges):
        pos = (m.topic, m.partition, m.offset)
        if pos in wanted:
            out[pos] = m.value if m.value is not None else b""
    return out


async def offset_bounds(
    bootstrap: str, topic: str, parts: Sequence[int]
) -> tuple[dict[int, int], dict[int, int]]:
    """(first, end) offset of each partition, as of now."""
    consumer = range_consumer(bootstrap)
    await consumer.start()
    try:
        return await end_offsets(consumer, topic, parts)
    finally:
        await consumer.stop()


async def stream_ranges(
    bootstrap: str, topic: str, ranges: Sequence[tuple[int, int, int]], first: int = 0
) -> AsyncIterator[tuple[int, Any]]:
    """(range index, message) for every message of `ranges[first:]` ((partition, start, end) each,
    end exclusive), one partition after the other, in offset order; streamed, so a large range
    is never held in memory."""
    from aiokafka import TopicPartition

    consumer = range_consumer(bootstrap)
    await consumer.start()
    try:
        for i in range(first, len(ranges)):
            part, lo, hi = ranges[i]
            if lo >= hi:
                continue
            tp = TopicPartition(topic, part)
            consumer.assign([tp])
            consumer.seek(tp, lo)
            while await consumer.position(tp) < hi:
                got = await consumer.getmany(tp, timeout_ms=500)
                for m in got.get(tp, []):
                    if m.offset >= hi:
                        break
                    yield i, m
    finally:
        await consumer.stop()
