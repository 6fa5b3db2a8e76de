"""SIGTERM under load: the worker stops fetching, finishes what it took, publishes, commits and
exits 0; the committed offset of each partition equals the outcomes published for it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from aiokafka.structs import ConsumerRecord
from worker_runs import WorkerTopics, run_worker_until

from schemas.codec import loads
from schemas.deadletter import DeadLetter
from schemas.record import DecisionRecord
from tests.pipeline.kafkautil import Tail, committed, encode, event, produce, read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def test_sigterm_commits_exactly_the_published_work(
    kafka_bootstrap: str, worker_args: list[str], tmp_path: Path
) -> None:
    topics = await WorkerTopics.create(kafka_bootstrap)
    n = 400  # a backlog far longer than the time SIGTERM takes to land, on any machine
    messages = [(None, encode(event(i, prefix="term")), i % 2) for i in range(n)]
    for i in (7, 20, 33):
        messages[i] = (None, b"not json", i % 2)
    await produce(kafka_bootstrap, topics.input, messages)
    args = [
        *worker_args,
        *topics.worker_args(),
        "--max-wait-ms",
        "5",
        "--max-batch-events",
        "2",
        "--max-queued-batches",
        "2",
        "--max-poll-records",
        "8",
    ]
    async with Tail(kafka_bootstrap, [topics.output, topics.dead_letters]) as out:
        code = await run_worker_until(
            args, tmp_path / "worker.log", lambda: len(out.messages) >= 6, 45, "the first outcomes"
        )
    log = (tmp_path / "worker.log").read_text()
    assert code == 0, log[-3000:]
    assert '"worker.stopped"' in log

    msgs = await read_all(
        kafka_bootstrap, [topics.output, topics.dead_letters], len(out.messages), settle=1.0
    )
    offsets = outcome_offsets(msgs, topics.output)
    done = await committed(kafka_bootstrap, topics.group, topics.input, 2)
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
