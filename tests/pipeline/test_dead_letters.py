"""Bad input lands in the dead-letter topic with its own reason; the worker keeps going and every
input offset gets exactly one outcome (a record or a dead letter)."""

from __future__ import annotations

import asyncio
import base64

import pytest

from prism_pipeline.worker.loop import Worker
from prism_pipeline.worker.settings import WorkerSettings
from schemas.codec import loads
from schemas.deadletter import DeadLetter
from schemas.record import DecisionRecord
from tests.pipeline.kafkautil import (
    committed,
    create_topics,
    encode,
    event,
    produce,
    read_all,
    unique,
    wait_for,
)

pytestmark = pytest.mark.kafka


def bad_inputs() -> list[tuple[str, bytes]]:
    """(expected reason, raw value) for each kind of bad input."""
    many_options = event(900)
    many_options["request"]["questions"] = {
        "c": {"type": "choice", "criteria": {f"o{i}": None for i in range(256)}}
    }
    big_state = event(901)
    big_state["request"]["state"] = "x" * 5000  # the worker runs with max_state_chars=4000
    unknown_type = event(902)
    unknown_type["request"]["questions"] = {"q": {"type": "ranking", "criteria": ["a", "b"]}}
    missing_field = event(903)
    del missing_field["tenant"]
    dup_ids = (
        b'{"event_id":"ev-0904","source":"alert","tenant":"acme","created_at":"2026-11-28T08:00:00Z",'
        b'"request":{"state":"disk full","questions":{"q":{"type":"noul"},"q":{"type":"noul"}}}}'
    )
    return [
        ("invalid_json", b'{"event_id": "ev-0905", "source": '),
        ("invalid_utf8", b'{"event_id": "ev-\xff\xfe"}'),
        ("schema_violation", encode(missing_field)),
        ("too_many_options", encode(many_options)),
        ("oversized_state", encode(big_state)),
        ("unknown_question_type", encode(unknown_type)),
        ("duplicate_question_ids", dup_ids),
    ]


async def test_bad_input_is_dead_lettered_and_every_offset_has_one_outcome(
    kafka_bootstrap: str, tiny_engine
) -> None:
    tin, tout, tdlq, group = unique("in"), unique("out"), unique("dlq"), unique("g")
    await create_topics(kafka_bootstrap, {tin: 1, tout: 1, tdlq: 1})
    bad = bad_inputs()
    # Interleave: good, bad, good, bad, ... so each bad message sits between decided ones.
    stream: list[tuple[str | None, bytes]] = []
    for i, (reason, raw) in enumerate(bad):
        stream.append((None, encode(event(i))))
        stream.append((reason, raw))
    stream.append((None, encode(event(len(bad)))))
    await produce(kafka_bootstrap, tin, [(b"k%d" % i, raw, 0) for i, (_, raw) in enumerate(stream)])

    settings = WorkerSettings(
        brokers=kafka_bootstrap,
        input_topic=tin,
        output_topic=tout,
        dlq_topic=tdlq,
        group_id=group,
        max_wait_ms=20,
        max_state_chars=4000,
    )
    worker = Worker(settings, tiny_engine)
    task = asyncio.create_task(worker.run())
    await wait_for(lambda: worker.published == len(stream) or task.done(), 50, "every outcome")
    worker.request_stop()
    await task

    msgs = await read_all(kafka_bootstrap, [tout, tdlq], len(stream), settle=0.5)
    outcomes: dict[int, tuple[str, object]] = {}
    for m in msgs:
        if m.topic == tout:
            obj: object = loads(m.value, DecisionRecord)
            off, kind = obj.input.offset, "record"  # type: ignore[attr-defined]
        else:
            obj = loads(m.value, DeadLetter)
            assert (obj.topic, obj.partition) == (tin, 0)  # type: ignore[attr-defined]
            off, kind = obj.offset, "dead_letter"  # type: ignore[attr-defined]
            assert m.key == b"k%d" % off  # keyed like the input message
        assert off not in outcomes, f"offset {off} has two outcomes"
        outcomes[off] = (kind, obj)
    assert len(msgs) == len(stream)
    assert sorted(outcomes) == list(range(len(stream)))  # one outcome per input offset
    for off, (expected_reason, raw) in enumerate(stream):
        kind, obj = outcomes[off]
        if expected_reason is None:
            assert kind == "record"
        else:
            assert kind == "dead_letter", f"offset {off} ({expected_reason}) was not dead-lettered"
            assert obj.reason == expected_reason  # type: ignore[attr-defined]
            assert base64.b64decode(obj.original_b64) == raw  # type: ignore[attr-defined]
            assert obj.original_size == len(raw)  # type: ignore[attr-defined]
            assert obj.message  # type: ignore[attr-defined]
    for reason, _ in bad:
        assert worker.metrics.value("prism_dead_letters_total", {"reason": reason}) == 1
    assert await committed(kafka_bootstrap, group, tin, 1) == {0: len(stream)}
