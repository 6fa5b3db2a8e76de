"""The local Kafka broker (ops/kafka) against aiokafka: the guarantees the pipeline relies on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition

from prism_pipeline.local_kafka import LocalKafka, LocalKafkaError, TopicSpec, wait_for_metadata

pytestmark = pytest.mark.timeout(180)


def _alive(pid: int) -> bool:
    """Any thread of pid still runs (a zombie, or a JVM whose main thread exited, is not enough)."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            return True
    return False


def _java_processes_for(workdir: Path) -> list[int]:
    """Live processes whose command line names this broker's config."""
    needle = str(workdir / "server.properties").encode()
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if needle in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return [p for p in pids if _alive(p)]


async def _drain(consumer: AIOKafkaConsumer, tps: Iterable[TopicPartition]) -> list[ConsumerRecord]:
    """Everything up to the end offsets taken now (the LSO under read_committed), in fetch order."""
    tps = list(tps)
    end = await consumer.end_offsets(tps)
    records: list[ConsumerRecord] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        positions = {tp: await consumer.position(tp) for tp in tps}
        if all(positions[tp] >= end[tp] for tp in tps):
            return records
        assert loop.time() < deadline, f"stuck at {positions}, end offsets {end}"
        for batch in (await consumer.getmany(*tps, timeout_ms=500)).values():
            records.extend(batch)


def _consumer(bootstrap: str, **kwargs: object) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest", **kwargs
    )


@pytest.mark.kafka
async def test_produce_consume_roundtrip(
    kafka_broker: LocalKafka, kafka_bootstrap: str, kafka_topic_name: Callable[[str], str]
) -> None:
    topic = kafka_topic_name("rt")
    await kafka_broker.create_topics([TopicSpec(topic, partitions=3)])
    sent: dict[tuple[int, int], tuple[bytes, bytes]] = {}
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(60):
            key, value = f"k{i % 7}".encode(), f"v{i}".encode()
            md = await producer.send_and_wait(topic, value, key=key)
            sent[(md.partition, md.offset)] = (key, value)
    finally:
        await producer.stop()
    # The acks are the oracle: each record sits at the partition and offset the broker acked,
    # and one key always lands in one partition.
    assert len({p for p, _ in sent}) > 1
    consumer = _consumer(kafka_bootstrap)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(3)]
        consumer.assign(tps)
        got = await _drain(consumer, tps)
    finally:
        await consumer.stop()
    assert {(r.partition, r.offset): (r.key, r.value) for r in got} == sent
    assert len(got) == len(sent)
    partition_of_key: dict[bytes, set[int]] = {}
    for r in got:
        partition_of_key.setdefault(r.key, set()).add(r.partition)
    assert all(len(parts) == 1 for parts in partition_of_key.values())


@pytest.mark.kafka
async def test_group_resumes_from_committed_offset(
    kafka_broker: LocalKafka, kafka_bootstrap: str, kafka_topic_name: Callable[[str], str]
) -> None:
    topic, group = kafka_topic_name("in"), kafka_topic_name("group")
    await kafka_broker.create_topics([topic])
    tp = TopicPartition(topic, 0)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(20):
            await producer.send_and_wait(topic, f"m{i}".encode())
    finally:
        await producer.stop()

    async def take(n: int) -> tuple[list[ConsumerRecord], int | None]:
        """Join the group, process n records, commit after the n-th, leave."""
        consumer = _consumer(kafka_bootstrap, group_id=group)
        await consumer.start()
        try:
            consumer.subscribe([topic])
            committed_at_start = None
            got: list[ConsumerRecord] = []
            while len(got) < n:
                batch = await consumer.getmany(timeout_ms=1000, max_records=n - len(got))
                if committed_at_start is None and batch:
                    committed_at_start = await consumer.committed(tp)
                for records in batch.values():
                    got.extend(records)
            await consumer.commit({tp: got[-1].offset + 1})
            return got, committed_at_start
        finally:
            await consumer.stop()

    first, committed_before_first = await take(8)
    second, committed_before_second = await take(12)
    assert committed_before_first is None
    assert committed_before_second == 8
    assert [r.offset for r in first] == list(range(8))
    assert [r.offset for r in second] == list(range(8, 20))
    assert [r.value for r in first + second] == [f"m{i}".encode() for i in range(20)]

    # The commit belongs to that group only: a new group starts from the beginning.
    other = _consumer(kafka_bootstrap, group_id=kafka_topic_name("other"))
    await other.start()
    try:
        assert await other.committed(tp) is None
        resumed = _consumer(kafka_bootstrap, group_id=group)
        await resumed.start()
        try:
            assert await resumed.committed(tp) == 20
        finally:
            await resumed.stop()
    finally:
        await other.stop()


@pytest.mark.kafka
async def test_transactional_consume_transform_produce(
    kafka_broker: LocalKafka, kafka_bootstrap: str, kafka_topic_name: Callable[[str], str]
) -> None:
    src, dst = kafka_topic_name("src"), kafka_topic_name("dst")
    group = kafka_topic_name("group")
    await kafka_broker.create_topics([src, dst])
    src_tp, dst_tp = TopicPartition(src, 0), TopicPartition(dst, 0)
    inputs = [f"event-{i}".encode() for i in range(10)]
    plain = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await plain.start()
    try:
        for value in inputs:
            await plain.send_and_wait(src, value)
    finally:
        await plain.stop()

    def transform(value: bytes) -> bytes:
        return value.upper()

    class Abort(Exception):
        pass

    async def process(n: int, *, abort: bool) -> None:
        """One consume-transform-produce step of n input records in one transaction."""
        consumer = _consumer(kafka_bootstrap, group_id=group, isolation_level="read_committed")
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"{group}-{src}-0")
        await consumer.start()
        await producer.start()
        try:
            consumer.assign([src_tp])
            got: list[ConsumerRecord] = []
            while len(got) < n:
                batch = await consumer.getmany(src_tp, timeout_ms=1000, max_records=n - len(got))
                got.extend(batch.get(src_tp, []))
            try:
                async with producer.transaction():
                    for record in got:
                        await producer.send(dst, transform(record.value), key=str(record.offset).encode())
                    await producer.send_offsets_to_transaction({src_tp: got[-1].offset + 1}, group)
                    if abort:
                        raise Abort
            except Abort:
                pass
        finally:
            await producer.stop()
            await consumer.stop()

    await process(6, abort=False)  # inputs 0..5 committed
    await process(4, abort=True)  # inputs 6..9 written, then aborted with their offsets
    checker = _consumer(kafka_bootstrap, group_id=group)
    await checker.start()
    try:
        # The aborted transaction's offset commit must not have landed: the group resumes at 6.
        assert await checker.committed(src_tp) == 6
    finally:
        await checker.stop()
    await process(4, abort=False)  # the restarted step replays 6..9 and commits them

    committed_view = _consumer(kafka_bootstrap, isolation_level="read_committed")
    everything_view = _consumer(kafka_bootstrap, isolation_level="read_uncommitted")
    await committed_view.start()
    await everything_view.start()
    try:
        committed_view.assign([dst_tp])
        everything_view.assign([dst_tp])
        committed = await _drain(committed_view, [dst_tp])
        everything = await _drain(everything_view, [dst_tp])
        checker = _consumer(kafka_bootstrap, group_id=group)
        await checker.start()
        try:
            final_commit = await checker.committed(src_tp)
        finally:
            await checker.stop()
    finally:
        await committed_view.stop()
        await everything_view.stop()

    expected = [transform(v) for v in inputs]
    # read_committed sees each transformed input exactly once, in order, and nothing aborted.
    assert [r.value for r in committed] == expected
    assert [r.key for r in committed] == [str(i).encode() for i in range(10)]
    # The aborted records really were written (the check above is not vacuous): an uncommitted
    # reader sees them between the first and the last transaction.
    assert [r.value for r in everything] == expected[:6] + expected[6:] + expected[6:]
    assert final_commit == 10


@pytest.mark.kafka
def test_stop_leaves_no_broker_process() -> None:
    broker = LocalKafka()
    bootstrap = broker.start()
    pid, workdir = broker.pid, broker.workdir
    try:
        assert pid is not None and _alive(pid)
        assert _java_processes_for(workdir) == [pid]
        assert wait_for_metadata(bootstrap, timeout=5) == 1
    finally:
        broker.stop()
    assert not _alive(pid)
    assert _java_processes_for(workdir) == []
    assert not workdir.exists()  # a temp dir the broker made is removed with it
    with pytest.raises(LocalKafkaError, match="not running"):
        _ = broker.bootstrap
    broker.stop()  # idempotent


def test_probe_of_a_closed_port_fails_with_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(LocalKafkaError, match=f"127.0.0.1:{port} not ready within 1s"):
            wait_for_metadata(f"127.0.0.1:{port}", timeout=1)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(LocalKafkaError, match="bad bootstrap address"):
        wait_for_metadata("no-port-here", timeout=1)
    with pytest.raises(ValueError, match="partitions must be >= 1"):
        TopicSpec("t", partitions=0)
    with pytest.raises(LocalKafkaError, match="Kafka script not found"):
        LocalKafka(script="/nonexistent/kafka.sh").start()
