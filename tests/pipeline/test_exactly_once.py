"""Exactly-once mode: a worker SIGKILLed mid-stream and restarted; a read_committed consumer sees
each event's outcome exactly once (aborted transactions stay invisible, offsets move with them)."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path

import pytest

from tests.pipeline.kafkautil import (
    Tail,
    committed,
    create_topics,
    encode,
    event,
    produce,
    read_all,
    spawn_worker,
    stop_worker,
    unique,
    wait_for,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def test_read_committed_consumer_sees_each_outcome_once(
    kafka_bootstrap: str, worker_args: list[str], tmp_path: Path
) -> None:
    tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
    await create_topics(kafka_bootstrap, {tin: 2, tout: 1, tdlq: 1})
    events = [event(i, prefix="eos") for i in range(24)]
    messages = [(e["event_id"].encode(), encode(e), i % 2) for i, e in enumerate(events)]
    messages[5] = (b"bad", b"{broken", 1)  # its dead letter goes through the same transactions
    await produce(kafka_bootstrap, tin, messages)
    common = [
        *worker_args,
        "--brokers",
        kafka_bootstrap,
        "--input-topic",
        tin,
        "--output-topic",
        tout,
        "--dlq-topic",
        tdlq,
        "--group-id",
        group,
        "--exactly-once",
        "--transactional-id-prefix",
        unique("tx"),
        "--max-wait-ms",
        "5",
        "--max-batch-events",
        "2",
        "--session-timeout-ms",
        "6000",
    ]
    async with Tail(kafka_bootstrap, [tout], read_committed=True) as out:
        first = spawn_worker(common, tmp_path / "first.log")
        try:
            await wait_for(
                lambda: len(out.messages) >= 4 or first.poll() is not None, 45, "committed records"
            )
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        assert len(out.messages) < len(events) - 1, "the worker finished before it could be killed"

        second = spawn_worker(common, tmp_path / "second.log")
        try:
            await wait_for(
                lambda: len(out.messages) >= len(events) - 1 or second.poll() is not None, 50, "every record"
            )
        finally:
            assert stop_worker(second, signal.SIGTERM) == 0, (tmp_path / "second.log").read_text()[-3000:]
        await asyncio.sleep(1.0)  # anything extra would show up now

    keys = Counter(m.key for m in out.messages)
    assert set(keys) == {k for k, _, _ in messages if k != b"bad"}
    assert all(n == 1 for n in keys.values()), {k: n for k, n in keys.items() if n > 1}
    letters = await read_all(kafka_bootstrap, [tdlq], 1, settle=1.0, read_committed=True)
    assert [m.key for m in letters] == [b"bad"]
    assert await committed(kafka_bootstrap, group, tin, 2) == {0: 12, 1: 12}
