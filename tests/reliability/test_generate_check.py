"""The generator and the checker against a real broker, on hand-built topics with known faults."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from ops.load import check as check_mod
from ops.load import generate as generate_mod
from ops.load.check import Checker, percentile
from ops.load.generate import Produced, generate, read_manifest, write_manifest
from tests.pipeline.kafkautil import create_topics, produce, read_all, unique

pytestmark = pytest.mark.kafka


def record(tin: str, offset: int, answer: str) -> bytes:
    return orjson.dumps(
        {
            "event_id": f"e{offset}",
            "answers": {"q": answer},
            "input": {"topic": tin, "partition": 0, "offset": offset},
        }
    )


def letter(tin: str, offset: int, reason: str) -> bytes:
    return orjson.dumps({"reason": reason, "topic": tin, "partition": 0, "offset": offset})


async def test_checker_finds_every_kind_of_fault(kafka_bootstrap: str) -> None:
    tin, tout, tdlq = unique("in"), unique("out"), unique("dlq")
    await create_topics(kafka_bootstrap, {tin: 1, tout: 1, tdlq: 1})
    await produce(kafka_bootstrap, tin, [(f"e{i}".encode(), b"{}", 0) for i in range(7)])
    await produce(
        kafka_bootstrap,
        tout,
        [
            (b"e0", record(tin, 0, "yes"), 0),  # fine
            (b"e1", record(tin, 1, "yes"), 0),  # duplicated, identical: allowed
            (b"e1", record(tin, 1, "yes"), 0),
            (b"e2", record(tin, 2, "yes"), 0),  # also dead-lettered: conflicting
            (b"e3", record(tin, 3, "yes"), 0),  # re-decided differently: divergent (offset and key)
            (b"e3", record(tin, 3, "no"), 0),
            (b"e6", record(tin, 6, "yes"), 0),  # offset 4: nothing at all (lost)
            (b"e9", record(tin, 99, "yes"), 0),  # names an offset the input does not hold: orphan
            (b"junk", b"not json", 0),  # not a record at all: orphan
        ],
    )
    await produce(
        kafka_bootstrap,
        tdlq,
        [(b"e2", letter(tin, 2, "invalid_json"), 0), (b"e5", letter(tin, 5, "invalid_json"), 0)],
    )
    manifest = [
        Produced(0, 5, "e5", "event", "record", None, "sample", 0),
        Produced(0, 6, "e6", "event", "record", None, "sample", 0),
    ]
    async with Checker(kafka_bootstrap, tin, tout, tdlq, manifest) as c:
        rep = await c.wait_complete(5)
    assert rep.inputs == 7 and rep.records == 9 and rep.dead_letters == 2
    assert rep.lost == [(0, 4)]
    assert rep.conflicting == [(0, 2)]
    assert rep.divergent == [(0, 3)]
    assert rep.divergent_keys == ["e3"]
    assert rep.duplicates == 1 + 1 + 1  # e1's copy, e2's second outcome, e3's second record
    assert [w[0] for w in rep.wrong] == [(0, 5)]  # a dead letter where a record was owed
    assert rep.orphans == 2
    assert not rep.ok and not rep.complete
    # An offset counts under its first outcome: offsets 0, 1, 2 (conflicting, record first), 3, 6.
    assert rep.reasons == {"record": 5, "dead_letter:invalid_json": 1}


async def test_generator_bounds_and_manifest_match_the_topic(kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = unique("gen")
    await create_topics(kafka_bootstrap, {topic: 3})
    rep = await generate(
        kafka_bootstrap, topic, count=90, producers=3, poison_fraction=0.2, prefix=unique("g")
    )
    assert len(rep.produced) == 90
    msgs = await read_all(kafka_bootstrap, [topic], 90, settle=0.5)
    on_topic = {(m.partition, m.offset): m.key.decode() for m in msgs}
    assert on_topic == {(p.partition, p.offset): p.key for p in rep.produced}  # no loss, no extra copies
    assert 5 < sum(p.kind == "poison" for p in rep.produced) < 35
    write_manifest(rep.produced, tmp_path / "m.jsonl")
    assert read_manifest(tmp_path / "m.jsonl") == rep.produced

    # A duration bound alone stops the generator (it returns, and not before the duration is
    # up); a paced rate caps it: message i is claimed no earlier than i / rate, so 1.5 s at 20/s
    # sends at most 31 (indices 0..30), however fast the machine. How many it reaches below that
    # cap, and how long in-flight sends take after the deadline, is the machine's speed: not asserted.
    timed = await generate(kafka_bootstrap, topic, duration_s=1.5, rate=20, prefix=unique("g"))
    assert len(timed.produced) <= 31 and timed.seconds >= 1.5


async def test_clis_round_trip(kafka_bootstrap: str, tmp_path: Path) -> None:
    tin, tout, tdlq = unique("in"), unique("out"), unique("dlq")
    await create_topics(kafka_bootstrap, {tin: 1, tout: 1, tdlq: 1})
    manifest = tmp_path / "m.jsonl"
    args = ["--brokers", kafka_bootstrap, "--topic", tin, "--count", "3", "--manifest", str(manifest)]
    assert await asyncio.to_thread(generate_mod.main, args) == 0
    assert len(read_manifest(manifest)) == 3
    # Nothing decided them: the checker CLI exits 1 (3 lost); a non-loopback broker is refused (2).
    common = ["--input-topic", tin, "--output-topic", tout, "--dlq-topic", tdlq]
    assert (
        await asyncio.to_thread(
            check_mod.main, ["--brokers", kafka_bootstrap, *common, "--manifest", str(manifest)]
        )
        == 1
    )
    assert await asyncio.to_thread(check_mod.main, ["--brokers", "192.0.2.1:9092", *common]) == 2
    assert await asyncio.to_thread(generate_mod.main, ["--brokers", kafka_bootstrap, "--topic", tin]) == 2


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (
        percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    )
    assert percentile([7.0], 1) == 7.0 and percentile([], 50) is None


async def test_checker_ignores_aborted_transactions_under_read_committed(kafka_bootstrap: str) -> None:
    """An exactly-once worker killed mid transaction leaves aborted records in the output log;
    they were never published, so the checker (read_committed, its default) must not count them,
    while a read_uncommitted view of the same topics shows they really are there."""
    from aiokafka import AIOKafkaProducer

    tin, tout, tdlq = unique("in"), unique("out"), unique("dlq")
    await create_topics(kafka_bootstrap, {tin: 1, tout: 1, tdlq: 1})
    await produce(kafka_bootstrap, tin, [(f"e{i}".encode(), b"{}", 0) for i in range(3)])
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=unique("tx"))
    await producer.start()
    try:
        async with producer.transaction():  # the published outcomes, one per input
            for i in range(3):
                await producer.send_and_wait(tout, record(tin, i, "yes"), key=f"e{i}".encode())
        with pytest.raises(RuntimeError, match="abort"):
            async with producer.transaction():  # a zombie's outcomes: decided differently, aborted
                await producer.send_and_wait(tout, record(tin, 1, "no"), key=b"e1")
                await producer.send_and_wait(tdlq, letter(tin, 2, "invalid_json"), key=b"e2")
                raise RuntimeError("abort")
    finally:
        await producer.stop()

    async with Checker(kafka_bootstrap, tin, tout, tdlq) as c:
        committed = await c.wait_complete(10, expected_inputs=3)
    assert c.isolation_level == "read_committed"
    assert committed.ok and committed.records == 3 and committed.dead_letters == 0, committed.summary()
    assert committed.duplicates == 0 and committed.divergent == [] and committed.conflicting == []

    async with Checker(kafka_bootstrap, tin, tout, tdlq, isolation_level="read_uncommitted") as c:
        everything = await c.wait_complete(10, expected_inputs=3)
    assert everything.records == 4 and everything.dead_letters == 1, everything.summary()
    assert everything.divergent == [(0, 1)] and everything.conflicting == [(0, 2)]
    assert everything.divergent_keys == ["e1"] and everything.duplicates == 2 and not everything.ok

    # The CLI reads committed data by default too.
    common = ["--brokers", kafka_bootstrap, "--input-topic", tin, "--output-topic", tout, "--dlq-topic", tdlq]
    assert await asyncio.to_thread(check_mod.main, common) == 0
    assert await asyncio.to_thread(check_mod.main, [*common, "--isolation", "read_uncommitted"]) == 1


def test_max_gap_is_the_longest_silence_around_a_window() -> None:
    from ops.load.scenarios import _max_gap_s

    stamps = [1000, 2000, 2500, 6500, 7000]  # outcome timestamps, ms
    # From the last outcome before the window (2.0 s) through those inside: 2.5 -> 6.5 s is longest.
    assert _max_gap_s(stamps, 2.2, 7.0) == 4.0
    assert _max_gap_s(stamps, 0.0, 2.1) == 1.0
    assert _max_gap_s(stamps, 10.0, 11.0) is None  # nothing published: no progress to measure from
