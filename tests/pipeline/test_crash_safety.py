"""A `prism run` process SIGKILLed mid-stream and restarted: nothing is lost, and every duplicate
record is byte-identical to the first (records are pure functions of their event)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from pathlib import Path

import pytest
from worker_runs import WorkerTopics, kill_worker_when, run_worker_until

from tests.pipeline.kafkautil import Tail, committed, encode, event, produce

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def test_sigkill_and_restart_loses_nothing_and_duplicates_are_identical(
    kafka_bootstrap: str, worker_args: list[str], tmp_path: Path
) -> None:
    topics = await WorkerTopics.create(kafka_bootstrap)
    events = [event(i, prefix="crash") for i in range(24)]
    messages = [(e["event_id"].encode(), encode(e), i % 2) for i, e in enumerate(events)]
    # Half the stream before the kill, half after: the first worker cannot finish the stream
    # before its kill lands, however fast the machine.
    await produce(kafka_bootstrap, topics.input, messages[:12])
    ids = {e["event_id"].encode() for e in events}
    common = [
        *worker_args,
        *topics.worker_args(),
        "--max-wait-ms",
        "5",
        "--session-timeout-ms",
        "6000",
        # The fp32 reference path is not batch invariant (float reductions follow the batch
        # shape), so byte-identical re-decisions need the same batches: one event per batch.
        "--max-batch-events",
        "1",
    ]
    async with Tail(kafka_bootstrap, [topics.output]) as out:
        # First worker: commits rarely, so everything it published before the kill is redone.
        await kill_worker_when(
            [*common, "--commit-interval-ms", "600000"],
            tmp_path / "first.log",
            lambda: len(out.messages) >= 6,
            45,
            "the first records",
        )
        await produce(kafka_bootstrap, topics.input, messages[12:])

        code = await run_worker_until(
            common, tmp_path / "second.log", lambda: out.keys() >= ids, 50, "a record for every event"
        )
        assert code == 0, (tmp_path / "second.log").read_text()[-3000:]
        await asyncio.sleep(0.5)

    by_key: dict[bytes, list[bytes]] = defaultdict(list)
    for m in out.messages:
        by_key[m.key].append(m.value)
    assert set(by_key) == ids
    duplicated = {k: v for k, v in by_key.items() if len(v) > 1}
    assert duplicated, "the kill produced no redelivery, so the test proved nothing"
    for key, values in duplicated.items():
        assert all(v == values[0] for v in values), f"duplicate records of {key!r} differ"
    assert await committed(kafka_bootstrap, topics.group, topics.input, 2) == {0: 12, 1: 12}
