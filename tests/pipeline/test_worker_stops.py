"""The worker's stop and group membership under faults (issue #23), each against a real broker.

- SIGTERM when every broker is gone: the drain cannot publish or commit; at `--stop-timeout-s` the
  worker abandons its in-flight work and exits 3, and (the broker back) every committed offset
  has its outcome on the output topics: nothing was committed that was not published.
- SIGTERM while the worker waits in the group join (another member is slow to rejoin): the
  worker exits; SIGUSR1 before it names the asyncio tasks.
- A group with short sessions (6 s) and a slow engine: a joining member makes the other revoke
  with a full queue; the revoke waits for one engine call only and the group settles after one
  rebalance, where the old revoke (the whole queue) outlasted the join window and the members
  were expelled in turn.

The exactly-once stop after a coordinator kill is tests/reliability/test_cluster_scenarios.py's.
"""

from __future__ import annotations

import asyncio
import signal
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from pydantic import ValidationError

from ops.load.slow_worker import SlowEngine
from prism_pipeline.local_kafka import LocalKafka
from prism_pipeline.worker.loop import Worker
from prism_pipeline.worker.runner import EXIT_ABANDONED
from prism_pipeline.worker.settings import WorkerSettings
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
    unique,
    wait_for,
)

pytestmark = pytest.mark.kafka

# Liveness bounds only: the stop deadline is 5 s, the watchdog's 30 s beyond it; a worker that
# has not exited by then hangs.
EXIT_BOUND_S = 60


def _flags(bootstrap: str, tin: str, tout: str, tdlq: str, group: str) -> list[str]:
    return [
        *("--brokers", bootstrap, "--input-topic", tin, "--output-topic", tout, "--dlq-topic", tdlq),
        *("--group-id", group, "--stop-timeout-s", "5"),
    ]


def _log_events(path: Path, name: str) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if f'"{name}"' in line:
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return out


def test_heartbeat_interval_is_checked_against_the_session_timeout() -> None:
    assert WorkerSettings(session_timeout_ms=6000).heartbeat_ms == 2000
    assert WorkerSettings().heartbeat_ms == 3000
    assert WorkerSettings(session_timeout_ms=6000, heartbeat_interval_ms=1500).heartbeat_ms == 1500
    with pytest.raises(ValidationError, match="at most 2000"):
        WorkerSettings(session_timeout_ms=6000, heartbeat_interval_ms=3000)
    # The join window covers the revoke's budget and one session to rejoin.
    assert WorkerSettings(session_timeout_ms=6000, revoke_timeout_s=10).rebalance_timeout_ms == 16000
    with pytest.raises(ValidationError, match="max_poll_interval_ms"):
        WorkerSettings(revoke_timeout_s=300, max_poll_interval_ms=300000)


@pytest.mark.slow
async def test_sigterm_with_every_broker_gone_abandons_in_flight_work_uncommitted(
    worker_args: list[str], tmp_path: Path
) -> None:
    broker = LocalKafka(tmp_path / "kafka")  # its own broker: this test stops it
    bootstrap = broker.start()
    try:
        tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
        await create_topics(bootstrap, {tin: 2, tout: 1, tdlq: 1})
        n = 80
        messages = [(None, encode(event(i, prefix="gone")), i % 2) for i in range(n)]
        messages[5] = (None, b"not json", 1)
        await produce(bootstrap, tin, messages)
        args = [
            *worker_args,
            *_flags(bootstrap, tin, tout, tdlq, group),
            *("--max-wait-ms", "5", "--max-batch-events", "2", "--max-poll-records", "8"),
        ]
        log_path = tmp_path / "worker.log"
        async with Tail(bootstrap, [tout, tdlq]) as out:
            proc = spawn_worker(args, log_path)
            await wait_for(lambda: len(out.messages) >= 6 or proc.poll() is not None, 90, "first outcomes")
        assert proc.poll() is None, log_path.read_text()[-3000:]
        await asyncio.to_thread(broker.stop)
        proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(proc.wait, EXIT_BOUND_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        log = log_path.read_text()
        assert code == EXIT_ABANDONED, log[-3000:]
        (abandoned,) = _log_events(log_path, "worker.stop_abandoned")
        assert abandoned["in_flight"], abandoned  # there was work in flight to abandon
        assert any(t["task"] == "prism-drain" for t in abandoned["waiting"]), abandoned
        assert '"worker.stop_forced"' not in log  # the loop itself ended, not the watchdog

        bootstrap = await asyncio.to_thread(broker.start)  # the same data, back
        msgs = await read_all(bootstrap, [tout, tdlq], 0, settle=3.0)
        done = await committed(bootstrap, group, tin, 2)
    finally:
        await asyncio.to_thread(broker.stop)
    published: dict[int, set[int]] = defaultdict(set)
    for m in msgs:
        if m.topic == tout:
            ref = loads(m.value, DecisionRecord).input
            published[ref.partition].add(ref.offset)
        else:
            letter = loads(m.value, DeadLetter)
            published[letter.partition].add(letter.offset)
    assert sum(v or 0 for v in done.values()) < n, "everything was committed: nothing was abandoned"
    for p in (0, 1):
        # Every offset below the committed one has its outcome; what is above goes to the next owner.
        assert set(range(done[p] or 0)) <= published[p], (p, done[p], sorted(published[p]))


class _SlowToRejoin(ConsumerRebalanceListener):
    """A group member whose revoke waits until released: the group's join stays open meanwhile."""

    def __init__(self) -> None:
        self.assigned = asyncio.Event()
        self.revoking = asyncio.Event()
        self.release = asyncio.Event()

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        if self.assigned.is_set():
            self.revoking.set()
            await self.release.wait()

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self.assigned.set()


@pytest.mark.slow
async def test_sigterm_during_the_group_join_exits(
    kafka_bootstrap: str, worker_args: list[str], tmp_path: Path
) -> None:
    tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
    await create_topics(kafka_bootstrap, {tin: 2, tout: 1, tdlq: 1})
    listener = _SlowToRejoin()
    member = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=group,
        enable_auto_commit=False,
        session_timeout_ms=10000,
        heartbeat_interval_ms=1000,
        rebalance_timeout_ms=120000,  # the join waits this long for it
    )
    await member.start()
    log_path = tmp_path / "worker.log"
    proc = None
    try:
        member.subscribe([tin], listener=listener)
        await asyncio.wait_for(listener.assigned.wait(), 30)
        proc = spawn_worker([*worker_args, *_flags(kafka_bootstrap, tin, tout, tdlq, group)], log_path)
        # The worker's JoinGroup made the member revoke: the worker now waits in the join.
        await asyncio.wait_for(listener.revoking.wait(), 90)
        await wait_for(lambda: '"worker.started"' in log_path.read_text(), 10, "the worker's start")
        proc.send_signal(signal.SIGUSR1)
        await wait_for(lambda: '"worker.tasks"' in log_path.read_text(), 10, "the task dump")
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, EXIT_BOUND_S)
    finally:
        listener.release.set()
        if proc is not None and proc.poll() is None:
            proc.kill()
        await member.stop()
    log = log_path.read_text()
    assert code == 0, log[-3000:]  # nothing was consumed, so nothing was abandoned
    assert '"partitions.assigned"' not in log, "the stop did not land in the join"
    assert '"worker.stopped"' in log
    assert "most recent call first" in log  # faulthandler's thread stacks, still chained in front
    (dump,) = _log_events(log_path, "worker.tasks")
    names = {t["task"] for t in dump["tasks"]}
    assert {"prism-fetch", "prism-engine"} <= names, names
    assert all(t["awaits"] for t in dump["tasks"] if t["task"].startswith("prism-")), dump


@pytest.mark.slow
async def test_short_sessions_rebalance_with_a_slow_engine_settles(
    kafka_bootstrap: str, tiny_engine, tiny_model: Path
) -> None:
    from engine.engine import Engine

    tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
    await create_topics(kafka_bootstrap, {tin: 4, tout: 1, tdlq: 1})
    events = [event(i, prefix="st") for i in range(40)]
    await produce(
        kafka_bootstrap, tin, [(e["event_id"].encode(), encode(e), i % 4) for i, e in enumerate(events)]
    )
    # A 6 s session, and a queue whose work (4 batches of 4 at 0.5 s an event: 8 s and more)
    # outlasts it: what a revoke that finished its queue first could not survive.
    kw = dict(
        session_timeout_ms=6000,
        max_wait_ms=1,
        max_batch_events=4,
        max_queued_batches=4,
        max_poll_records=16,
    )

    def settings(name: str) -> WorkerSettings:
        return WorkerSettings(
            brokers=kafka_bootstrap,
            input_topic=tin,
            output_topic=tout,
            dlq_topic=tdlq,
            group_id=group,
            worker_id=name,
            **kw,
        )

    other = await asyncio.to_thread(Engine.load, tiny_model, "cpu", "fp32", tiny_engine.decision_config)
    a = Worker(settings("a"), SlowEngine(tiny_engine, 0.5))
    b = Worker(settings("b"), SlowEngine(other, 0.5))
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
    by_key: dict[bytes, set[bytes]] = defaultdict(set)
    for m in out.messages:
        by_key[m.key].add(m.value)
    assert set(by_key) == {e["event_id"].encode() for e in events}
    assert all(len(v) == 1 for v in by_key.values()), "a re-decided event's record changed"
    assert await committed(kafka_bootstrap, group, tin, 4) == {p: len(events) // 4 for p in range(4)}
