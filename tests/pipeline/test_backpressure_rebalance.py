"""Backpressure (pause/resume), and rebalances between two workers of one group: one that takes
partitions without loss, one with short sessions and a slow engine that settles."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import pytest

from ops.load.slow_worker import SlowEngine
from prism_pipeline.worker.loop import Worker
from prism_pipeline.worker.settings import WorkerSettings
from tests.pipeline.kafkautil import Tail, committed, create_topics, encode, event, produce, unique, wait_for

pytestmark = pytest.mark.kafka


def settings(bootstrap: str, tin: str, tout: str, tdlq: str, group: str, **kw) -> WorkerSettings:
    return WorkerSettings(
        brokers=bootstrap, input_topic=tin, output_topic=tout, dlq_topic=tdlq, group_id=group, **kw
    )


async def test_full_queue_pauses_fetching_and_everything_is_still_decided(
    kafka_bootstrap: str, tiny_engine
) -> None:
    tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
    await create_topics(kafka_bootstrap, {tin: 1, tout: 1, tdlq: 1})
    n = 16
    await produce(kafka_bootstrap, tin, [(None, encode(event(i, prefix="bp")), 0) for i in range(n)])
    s = settings(
        kafka_bootstrap, tin, tout, tdlq, group, max_wait_ms=1, max_batch_events=1, max_queued_batches=2
    )
    worker = Worker(s, tiny_engine)
    task = asyncio.create_task(worker.run())
    await wait_for(lambda: worker.published == n or task.done(), 50, "all records")
    worker.request_stop()
    await task
    assert worker.metrics.value("prism_backpressure_pauses_total") >= 1
    assert worker.metrics.value("prism_partitions_paused") == 0  # resumed once drained
    assert worker.metrics.value("prism_batch_events_count") == n  # one event per batch, none lost
    assert await committed(kafka_bootstrap, group, tin, 1) == {0: n}


@pytest.mark.slow
async def test_second_worker_joining_takes_partitions_without_loss(
    kafka_bootstrap: str, tiny_engine, tiny_model: Path
) -> None:
    tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
    await create_topics(kafka_bootstrap, {tin: 4, tout: 1, tdlq: 1})
    events = [event(i, prefix="rb") for i in range(48)]
    first, later = events[:16], events[16:]

    async def send(batch: list[dict]) -> None:
        await produce(
            kafka_bootstrap,
            tin,
            [(e["event_id"].encode(), encode(e), int(e["event_id"][-4:]) % 4) for e in batch],
        )

    # Byte-identical duplicates across workers need identical batches on the fp32 path: one event each.
    kw = dict(max_wait_ms=1, max_batch_events=1, session_timeout_ms=6000)
    a = Worker(settings(kafka_bootstrap, tin, tout, tdlq, group, worker_id="a", **kw), tiny_engine)
    b = Worker(
        settings(kafka_bootstrap, tin, tout, tdlq, group, worker_id="b", **kw),
        await another_engine(tiny_engine, tiny_model),
    )
    async with Tail(kafka_bootstrap, [tout]) as out:
        ta = asyncio.create_task(a.run())
        await send(first)
        await wait_for(lambda: a.published >= len(first) or ta.done(), 40, "worker a's records")
        assert len(a.assigned) == 4
        tb = asyncio.create_task(b.run())
        # a is revoked (finishes its engine call, commits), then both get two partitions each.
        await wait_for(
            lambda: (len(a.assigned), len(b.assigned)) == (2, 2) or ta.done() or tb.done(), 40, "rebalance"
        )
        await send(later)
        await wait_for(lambda: len(out.keys()) == len(events) or ta.done() or tb.done(), 50, "every record")
        a.request_stop()
        b.request_stop()
        await asyncio.gather(ta, tb)
        await asyncio.sleep(0.5)
    assert a.published > len(first) and b.published > 0, (a.published, b.published)
    await assert_each_event_decided_once(kafka_bootstrap, out, events, group, tin)


async def another_engine(tiny_engine, tiny_model: Path):  # -> engine.Engine
    """A second engine like `tiny_engine`, for a second worker (each engine has one thread)."""
    from engine.engine import Engine

    return await asyncio.to_thread(Engine.load, tiny_model, "cpu", "fp32", tiny_engine.decision_config)


async def assert_each_event_decided_once(
    bootstrap: str, out: Tail, events: list[dict], group: str, tin: str
) -> None:
    """Every event has a record, all of a key's records are the same bytes, and each of the four
    input partitions is committed to its end."""
    by_key: dict[bytes, set[bytes]] = defaultdict(set)
    for m in out.messages:
        by_key[m.key].add(m.value)
    assert set(by_key) == {e["event_id"].encode() for e in events}
    assert all(len(v) == 1 for v in by_key.values()), "a re-decided event's record changed"
    assert await committed(bootstrap, group, tin, 4) == {p: len(events) // 4 for p in range(4)}


@pytest.mark.slow
async def test_short_sessions_rebalance_with_a_slow_engine_settles(
    kafka_bootstrap: str, tiny_engine, tiny_model: Path
) -> None:
    """Issue #23: with 6 s sessions a member whose revoke finished its whole queue first (10 s on a
    slow engine) missed the join window and was expelled, and the group rebalanced in turn without
    end. Now a revoke waits for one engine call, and the join window covers the revoke's budget."""
    tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
    await create_topics(kafka_bootstrap, {tin: 4, tout: 1, tdlq: 1})
    events = [event(i, prefix="st") for i in range(40)]
    await produce(
        kafka_bootstrap, tin, [(e["event_id"].encode(), encode(e), i % 4) for i, e in enumerate(events)]
    )
    # A 6 s session, and a queue whose work (4 batches of 4 at 0.5 s an event: 8 s and more)
    # outlasts it. The engine stand-in's cost is declared: the tiny model plus 0.5 s an event.
    kw = dict(session_timeout_ms=6000, max_wait_ms=1, max_batch_events=4, max_queued_batches=4)
    kw |= dict(max_poll_records=16)
    a = Worker(
        settings(kafka_bootstrap, tin, tout, tdlq, group, worker_id="a", **kw), SlowEngine(tiny_engine, 0.5)
    )
    b = Worker(
        settings(kafka_bootstrap, tin, tout, tdlq, group, worker_id="b", **kw),
        SlowEngine(await another_engine(tiny_engine, tiny_model), 0.5),
    )
    async with Tail(kafka_bootstrap, [tout]) as out:
        ta = asyncio.create_task(a.run())
        await wait_for(lambda: a.published >= 4 or ta.done(), 60, "worker a's first records")
        queued = a.metrics.value("prism_queued_batches")
        assert queued >= 2, f"a's queue held {queued} batches when b joined: nothing was tested"
        tb = asyncio.create_task(b.run())
        await wait_for(lambda: len(out.keys()) == len(events) or ta.done() or tb.done(), 120, "every record")
        settled = (a.assignments, b.assignments, len(a.assigned), len(b.assigned))
        a.request_stop()
        b.request_stop()
        await asyncio.gather(ta, tb)
    # One rebalance: a was assigned at its start and once more, b once; two partitions each.
    assert settled == (2, 1, 2, 2), settled
    await assert_each_event_decided_once(kafka_bootstrap, out, events, group, tin)
