"""The pipeline-alone benchmark's harness (ops/bench/bench_pipeline.py, ops/load/standin_engine.py),
run for a few hundred events against the real local broker: correctness only, never timings.

The oracles are independent of the worker: the checker reconciles every input offset with the
topics' contents (exactly one outcome each, the kind the generator says it is owed), every record
is parsed against the record contract, and each record's bytes equal what the stand-in engine
decides for its input event when called directly in this process (what the worker published is
the pure function of the event, not something the run made up).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer

from ops.load.standin_engine import StandinEngine
from prism_pipeline.core.decide import DecisionRules, Origin, decide_batch, prepare, settle
from prism_pipeline.core.records import provenance, record_message
from schemas.record import DecisionRecord, InputRef

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "bench"))
from bench_pipeline import BenchConfig, run_config  # noqa: E402

pytestmark = pytest.mark.timeout(300)


async def _read_all(bootstrap: str, topic: str) -> list[tuple[int, int, bytes]]:
    c = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, isolation_level="read_committed", auto_offset_reset="earliest"
    )
    await c.start()
    out: list[tuple[int, int, bytes]] = []
    try:
        got = await c.getmany(timeout_ms=1000)
        parts = sorted(c.assignment())
        ends = await c.end_offsets(parts)
        while True:
            for msgs in got.values():
                out += [(m.partition, m.offset, m.value) for m in msgs]
            if not [tp for tp in parts if await c.position(tp) < ends[tp]]:
                return out
            got = await c.getmany(timeout_ms=1000)
    finally:
        await c.stop()


@pytest.mark.parametrize("exactly_once", [False, True], ids=["at-least-once", "exactly-once"])
def test_harness_every_event_one_valid_outcome(
    kafka_bootstrap: str, tmp_path: Path, exactly_once: bool
) -> None:
    cfg = BenchConfig(
        partitions=4,
        exactly_once=exactly_once,
        cost_us=200.0,
        backlog=240,
        latency_events=60,
        latency_rate=200.0,
        poison_fraction=0.1,
    )
    r = asyncio.run(run_config(kafka_bootstrap, cfg, tmp_path))
    check = r["check"]
    assert check["inputs"] == 300
    assert check["records"] + check["dead_letters"] == 300
    assert check["dead_letters"] > 0  # the poison went to the dead-letter topic, each once
    for what in ("lost", "conflicting", "divergent", "duplicates", "wrong", "orphans"):
        assert check[what] == 0, (what, check)
    assert check["ok"]
    assert r["records_invalid"] == 0
    assert r["worker_rc"] == 0
    assert 0 < r["latency_events"] < 60  # the paced events owed a record (the poison is not)
    assert r["latency_seen"] == r["latency_events"]  # every one's record was seen arriving

    # Each record is the stand-in's decision of its input event, byte for byte.
    topic = r["topics"]
    inputs = {(p, o): v for p, o, v in asyncio.run(_read_all(kafka_bootstrap, topic["in"]))}
    records = asyncio.run(_read_all(kafka_bootstrap, topic["out"]))
    assert len(records) == check["records"]
    engine = StandinEngine(cfg.cost_us)
    model = provenance(engine)
    for _, _, value in records:
        rec = DecisionRecord.model_validate_json(value)
        assert rec.input is not None and rec.input.topic == topic["in"]
        raw = inputs[(rec.input.partition, rec.input.offset)]
        prep = prepare(raw, engine, DecisionRules())
        assert not isinstance(prep, Exception)
        res = decide_batch(engine.decide, [prep.request]).results[0]
        src = InputRef(topic=topic["in"], partition=rec.input.partition, offset=rec.input.offset)
        origin = Origin(src.topic, src.partition, src.offset)
        want = settle(raw, prep, res, model, origin, source=src)
        assert isinstance(want, DecisionRecord)
        assert record_message(want, "x", []).value == value
        assert orjson.loads(value)["model"]["name"] == "prism-standin-engine"
