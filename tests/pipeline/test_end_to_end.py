"""N events in -> N decision records out, through a real broker and the real engine (tiny model)."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import urllib.request
from pathlib import Path

import pytest

from prism_pipeline.core.seeds import derive_seed
from prism_pipeline.offline.verify import PublishedRecord, redecide
from prism_pipeline.worker.loop import Worker
from prism_pipeline.worker.settings import WorkerSettings
from schemas.codec import loads
from schemas.record import DecisionRecord
from tests.pipeline.kafkautil import (
    create_topics,
    encode,
    event,
    headers,
    produce,
    read_all,
    unique,
    wait_for,
)

pytestmark = pytest.mark.kafka


def settings_for(bootstrap: str, tin: str, tout: str, tdlq: str, **kw) -> WorkerSettings:
    return WorkerSettings(
        brokers=bootstrap,
        input_topic=tin,
        output_topic=tout,
        dlq_topic=tdlq,
        group_id=unique("g"),
        max_wait_ms=20,
        worker_id="test-worker",
        **kw,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_events_in_records_out(kafka_bootstrap: str, tiny_engine, tiny_model: Path) -> None:
    tin, tout, tdlq = unique("in"), unique("out"), unique("dlq")
    await create_topics(kafka_bootstrap, {tin: 3, tout: 1, tdlq: 1})
    events = [event(i) for i in range(12)]
    events[3]["seed"] = 12345
    events[5]["gate"] = 1.0  # this one thinks (budget 3 tokens), then reads the letters again
    events[7]["request"]["questions"] = {
        f"c{k}": {"type": "choice", "criteria": {f"opt{j}": None for j in range(3 + k)}} for k in range(2)
    }
    sent = await produce(
        kafka_bootstrap, tin, [(e["event_id"].encode(), encode(e), i % 3) for i, e in enumerate(events)]
    )
    where = {e["event_id"]: (md.partition, md.offset) for e, md in zip(events, sent, strict=True)}

    port = free_port()
    worker = Worker(settings_for(kafka_bootstrap, tin, tout, tdlq, metrics_port=port), tiny_engine)
    task = asyncio.create_task(worker.run())
    await wait_for(lambda: worker.published == len(events) or task.done(), 50, "all records")
    scraped = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
    )
    worker.request_stop()
    await task

    msgs = await read_all(kafka_bootstrap, [tout, tdlq], len(events), settle=0.5)
    assert all(m.topic == tout for m in msgs), "no valid event may be dead-lettered"
    assert len(msgs) == len(events)
    by_id = {}
    for m in msgs:
        rec = loads(m.value, DecisionRecord)
        assert m.key == rec.event_id.encode()
        by_id[rec.event_id] = (rec, m)
    assert set(by_id) == set(where)

    file_digest = hashlib.sha256(tiny_model.read_bytes()).hexdigest()
    for e in events:
        rec, m = by_id[e["event_id"]]
        assert (rec.input.topic, rec.input.partition, rec.input.offset) == (tin, *where[e["event_id"]])
        assert rec.model.file_digest == file_digest
        assert rec.model.precision == "fp32"
        assert rec.model.decision_config_digest == tiny_engine.decision_config.digest()
        assert rec.model.render_version == tiny_engine.render_version
        assert rec.seed == (e["seed"] if "seed" in e else derive_seed(e["event_id"]))
        assert (rec.source, rec.tenant) == (e["source"], e["tenant"])
        qs = e["request"]["questions"]
        assert list(rec.answers) == list(qs)  # the event's question order
        for qid, q in qs.items():
            a = rec.answers[qid]
            assert a.type == q["type"]
            if a.type == "noul":
                assert 0.0 <= a.noul <= 1.0
            elif a.type == "choice":
                assert list(a.probabilities) == list(q["criteria"])
                assert a.choice == max(a.probabilities, key=a.probabilities.get)
            else:
                n = len(q["criteria"])
                assert list(a.probabilities) == [str(k) for k in range(n)]
                assert list(a.legend.values()) == q["criteria"]
                assert a.score == pytest.approx(sum(k * p for k, p in enumerate(a.probabilities.values())))
            assert (rec.questions[qid].second is not None) == (e.get("gate") == 1.0)
        h = headers(m)
        assert h["prism-worker"] == b"test-worker" and h["prism-attempt"] == b"1"
        assert float(h["prism-t-engine-ms"]) > 0
    assert f"prism_records_out_total {float(len(events))}".encode() in scraped
    assert b"prism_end_to_end_seconds_bucket" in scraped and b"prism_autothink_rate" in scraped
    assert worker.metrics.value("prism_records_out_total") == len(events)
    assert worker.metrics.value("prism_events_in_total") == len(events)
    assert worker.metrics.value("prism_questions_thought_total") == len(events[5]["request"]["questions"])

    # Replay: re-deciding each batch reproduces every record byte for byte.
    raw = {
        (m.partition, m.offset): m.value
        for m in await read_all(kafka_bootstrap, [tin], len(events), settle=0)
    }
    published = [
        PublishedRecord(
            value=m.value,
            event_raw=raw[(rec.input.partition, rec.input.offset)],
            input=rec.input,
            batch=headers(m)["prism-batch"].decode(),
            batch_pos=int(headers(m)["prism-batch-pos"]),
        )
        for rec, m in by_id.values()
    ]
    assert redecide(tiny_engine, published) == []
