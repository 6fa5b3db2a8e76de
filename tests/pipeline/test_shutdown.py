"""SIGTERM under load: the worker stops fetching, finishes what it took, publishes, commits and
exits 0; the committed offset of each partition equals the outcomes published for it."""

from __future__ import annotations

import signal
from collections import defaultdict
from pathlib import Path

import pytest
from aiokafka.structs import ConsumerRecord

from schemas.codec import loads
from schemas.deadletter import DeadLetter
from schemas.record import DecisionRecord
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


async def test_sigterm_commits_exactly_the_published_work(
    kafka_bootstrap: str, worker_args: list[str], tmp_path: Path
) -> None:
    tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
    await create_topics(kafka_bootstrap, {tin: 2, tout: 1, tdlq: 1})
    n = 60
    messages = [(None, encode(event(i, prefix="term")), i % 2) for i in range(n)]
    for i in (7, 20, 33):
        messages[i] = (None, b"not json", i % 2)
    await produce(kafka_bootstrap, tin, messages)
    args = [
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
        "--max-batch-events",
        "2",
        "--max-queued-batches",
        "2",
        "--max-poll-records",
        "8",
    ]
    async with Tail(kafka_bootstrap, [tout, tdlq]) as out:
        proc = spawn_worker(args, tmp_path / "worker.log")
        try:
            await wait_for(
                lambda: len(out.messages) >= 6 or proc.poll() is not None, 45, "the first outcomes"
            )
        finally:
            code = stop_worker(proc, signal.SIGTERM)
    log = (tmp_path / "worker.log").read_text()
    assert code == 0, log[-3000:]
    assert '"worker.stopped"' in log

    msgs = await read_all(kafka_bootstrap, [tout, tdlq], len(out.messages), settle=1.0)
    offsets = outcome_offsets(msgs, tout)
    done = await committed(kafka_bootstrap, group, tin, 2)
    assert sum(len(v) for v in offsets.values()) < n, "SIGTERM came after all the work: nothing was tested"
    for p in (0, 1):
        # Each partition's outcomes are exactly its offsets 0..committed-1, each once.
        assert sorted(offsets[p]) == list(range(done[p] or 0)), (p, done[p], sorted(offsets[p]))
    assert '"backpressure.pause"' in log  # the queue bound was hit while it ran


def outcome_offsets(msgs: list[ConsumerRecord], output_topic: str) -> dict[int, list[int]]:
    """Input partition -> the input offsets that have an outcome (a record on `output_topic`, or
    a dead letter), read from the outcomes themselves: the oracle the committed offsets meet."""
    offsets: dict[int, list[int]] = defaultdict(list)
    for m in msgs:
        if m.topic == output_topic:
            ref = loads(m.value, DecisionRecord).input
            offsets[ref.partition].append(ref.offset)
        else:
            letter = loads(m.value, DeadLetter)
            offsets[letter.partition].append(letter.offset)
    return offsets
