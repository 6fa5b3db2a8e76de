"""The worker's stop and group membership under faults (issue #23), each against a real broker.

- SIGTERM when every broker is gone: the drain cannot publish or commit; at `--stop-timeout-s` the
  worker abandons its in-flight work and exits 3, and (the broker back) every committed offset
  has its outcome on the output topics: nothing was committed that was not published.
- SIGTERM while the worker waits in the group join (another member is slow to rejoin): the
  worker exits; SIGUSR1 before it names the asyncio tasks.

The rebalance with short sessions that settles is in test_backpressure_rebalance.py; the
exactly-once stop after a coordinator kill is tests/reliability/test_cluster_scenarios.py's.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterable
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from pydantic import ValidationError

from prism_pipeline.local_kafka import LocalKafka
from prism_pipeline.worker.runner import EXIT_ABANDONED
from prism_pipeline.worker.settings import WorkerSettings
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
from tests.pipeline.test_shutdown import outcome_offsets

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
    published = outcome_offsets(msgs, tout)
    assert sum(v or 0 for v in done.values()) < n, "everything was committed: nothing was abandoned"
    for p in (0, 1):
        # Every offset below the committed one has its outcome; what is above goes to the next owner.
        assert set(range(done[p] or 0)) <= set(published[p]), (p, done[p], sorted(published[p]))


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
