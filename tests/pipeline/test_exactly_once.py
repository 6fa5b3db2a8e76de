"""Exactly-once mode: a worker SIGKILLed mid-stream and restarted; a read_committed consumer sees
each event's outcome exactly once (aborted transactions stay invisible, offsets move with them)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from worker_runs import WorkerTopics, kill_worker_when, run_worker_until

from tests.pipeline.kafkautil import Tail, committed, encode, event, produce, read_all, unique

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def test_read_committed_consumer_sees_each_outcome_once(
    kafka_bootstrap: str, worker_args: list[str], tmp_path: Path
) -> None:
    topics = await WorkerTopics.create(kafka_bootstrap)
    events = [event(i, prefix="eos") for i in range(24)]
    messages = [(e["event_id"].encode(), encode(e), i % 2) for i, e in enumerate(events)]
    messages[5] = (b"bad", b"{broken", 1)  # its dead letter goes through the same transactions
    # Half the stream before the kill, half after: the first worker cannot finish the stream
    # before its kill lands, however fast the machine.
    await produce(kafka_bootstrap, topics.input, messages[:12])
    common = [
        *worker_args,
        *topics.worker_args(),
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
    async with Tail(kafka_bootstrap, [topics.output], read_committed=True) as out:
        await kill_worker_when(
            common, tmp_path / "first.log", lambda: len(out.messages) >= 4, 45, "committed records"
        )
        await produce(kafka_bootstrap, topics.input, messages[12:])

        code = await run_worker_until(
            common, tmp_path / "second.log", lambda: len(out.messages) >= len(events) - 1, 50, "every record"
        )
        assert code == 0, (tmp_path / "second.log").read_text()[-3000:]
        await asyncio.sleep(1.0)  # anything extra would show up now

    keys = Counter(m.key for m in out.messages)
    assert set(keys) == {k for k, _, _ in messages if k != b"bad"}
    assert all(n == 1 for n in keys.values()), {k: n for k, n in keys.items() if n > 1}
    letters = await read_all(kafka_bootstrap, [topics.dead_letters], 1, settle=1.0, read_committed=True)
    assert [m.key for m in letters] == [b"bad"]
    assert await committed(kafka_bootstrap, topics.group, topics.input, 2) == {0: 12, 1: 12}
