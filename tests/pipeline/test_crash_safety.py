"""A `prism run` process SIGKILLed mid-stream and restarted: nothing is lost, and every duplicate
record is byte-identical to the first (records are pure functions of their event)."""

from __future__ import annotations

import asyncio
import signal
from collections import defaultdict
from pathlib import Path

import pytest

from tests.pipeline.kafkautil import (
    Tail,
    committed,
    create_topics,
    encode,
    event,
    produce,
    spawn_worker,
    stop_worker,
    unique,
    wait_for,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def test_sigkill_and_restart_loses_nothing_and_duplicates_are_identical(
    kafka_bootstrap: str, worker_args: list[str], tmp_path: Path
) -> None:
    tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
    await create_topics(kafka_bootstrap, {tin: 2, tout: 1, tdlq: 1})
    events = [event(i, prefix="crash") for i in range(24)]
    await produce(
        kafka_bootstrap, tin, [(e["event_id"].encode(), encode(e), i % 2) for i, e in enumerate(events)]
    )
    ids = {e["event_id"].encode() for e in events}
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
        "--max-wait-ms",
        "5",
        "--session-timeout-ms",
        "6000",
        # The fp32 reference path is not batch invariant (float reductions follow the batch
        # shape), so byte-identical re-decisions need the same batches: one event per batch.
        "--max-batch-events",
        "1",
    ]
    async with Tail(kafka_bootstrap, [tout]) as out:
        # First worker: commits rarely, so everything it published before the kill is redone.
        first = spawn_worker([*common, "--commit-interval-ms", "600000"], tmp_path / "first.log")
        try:
            await wait_for(
                lambda: len(out.messages) >= 6 or first.poll() is not None, 45, "the first records"
            )
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(10)
        before_restart = len(out.messages)
        assert before_restart < len(events), "the worker finished before it could be killed"

        second = spawn_worker(common, tmp_path / "second.log")
        try:
            await wait_for(
                lambda: out.keys() >= ids or second.poll() is not None, 50, "a record for every event"
            )
        finally:
            assert stop_worker(second, signal.SIGTERM) == 0, (tmp_path / "second.log").read_text()[-3000:]
        await asyncio.sleep(0.5)

    by_key: dict[bytes, list[bytes]] = defaultdict(list)
    for m in out.messages:
        by_key[m.key].append(m.value)
    assert set(by_key) == ids
    duplicated = {k: v for k, v in by_key.items() if len(v) > 1}
    assert duplicated, "the kill produced no redelivery, so the test proved nothing"
    for key, values in duplicated.items():
        assert all(v == values[0] for v in values), f"duplicate records of {key!r} differ"
    assert await committed(kafka_bootstrap, group, tin, 2) == {0: 12, 1: 12}
