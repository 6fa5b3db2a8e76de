"""`prism replay`: a topic produced by the real worker replays 100% identical on the int8 path; a
tampered record, another model file, another precision or decision config are detected."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from engine.decide.decision_config import DecisionConfig
from prism_pipeline.offline.engines import EngineSource
from prism_pipeline.offline.errors import ReplayRefused
from prism_pipeline.offline.record_diff import record_diff
from prism_pipeline.offline.replay import replay
from prism_pipeline.offline.report import render_report
from prism_pipeline.offline.selection import Selection
from prism_pipeline.worker.loop import Worker
from prism_pipeline.worker.settings import WorkerSettings
from tests.pipeline.conftest import TEST_GATE, TEST_THOUGHT_BUDGET
from tests.pipeline.kafkautil import REPO, create_topics, encode, event, read_all, unique, wait_for

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=3)  # within any retention
N_EVENTS = 10
THINKER = "rp-0004"  # gate 1.0: AutoThink writes a thought and reads the letters again


# ---- field-level diff (no broker) ---------------------------------------------------------------------


def test_record_diff_names_paths_and_shows_float_bits() -> None:
    a = {"event_id": "e", "seed": 1, "p": [0.25, 0.75], "m": {"x": -0.0, "y": "s"}}
    b = {"event_id": "e", "seed": 1, "p": [0.25, math.nextafter(0.75, 1.0)], "m": {"x": 0.0, "y": "s"}}
    diffs = record_diff(orjson.dumps(a), orjson.dumps(b))
    assert [d.path for d in diffs] == ["p[1]", "m.x"]
    text = diffs[0].render()
    assert (0.75).hex() in text and math.nextafter(0.75, 1.0).hex() in text
    assert record_diff(orjson.dumps(a), orjson.dumps(a)) == []


def test_record_diff_reports_absent_fields_lengths_and_key_order() -> None:
    a = {"a": 1, "b": [1, 2, 3], "c": {"k": 1, "l": 2}}
    b = {"a": 1.0, "b": [1, 2], "c": {"l": 2, "k": 1}, "d": None}
    paths = {d.path: d for d in record_diff(orjson.dumps(a), orjson.dumps(b))}
    assert set(paths) == {"a", "b[2]", "c<key order>", "d"}  # 1 vs 1.0 differs: different bytes
    assert "<absent>" in paths["b[2]"].render() and "<absent>" in paths["d"].render()


def test_record_diff_same_values_other_bytes() -> None:
    diffs = record_diff(b'{"a":1}', b'{"a": 1}')
    assert len(diffs) == 1 and diffs[0].path.startswith("<bytes at 5")


# ---- against the real broker and the real worker --------------------------------------------------------


@pytest.fixture(scope="module")
def int8_engine(tiny_model: Path):  # -> engine.Engine
    from engine.engine import Engine

    return Engine.load(
        tiny_model,
        device="cpu",
        precision="int8",
        decision_config=DecisionConfig(gate=TEST_GATE, thought_budget=TEST_THOUGHT_BUDGET),
    )


@pytest.fixture(scope="module")
def other_model(gguf_model: Callable[..., Path]) -> Path:
    return gguf_model("Q8_0", "tiny", seed=1)


def _events() -> list[dict]:
    evs = [event(i, prefix="rp") for i in range(N_EVENTS)]
    evs[4]["gate"] = 1.0
    evs[6]["seed"] = 4242
    return evs


async def _produce_timed(bootstrap: str, topic: str, values: list[tuple[bytes | None, bytes, int, datetime]]):
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await p.start()
    try:
        futs = [
            await p.send(topic, v, key=k, partition=part, timestamp_ms=int(ts.timestamp() * 1000))
            for k, v, part, ts in values
        ]
        return [await f for f in futs]
    finally:
        await p.stop()


async def _run_worker(bootstrap: str, engine, tin: str, tout: str, tdlq: str, expected: int, **kw) -> None:
    settings = WorkerSettings(
        brokers=bootstrap,
        input_topic=tin,
        output_topic=tout,
        dlq_topic=tdlq,
        group_id=unique("g"),
        worker_id="replay-test",
        **{"max_wait_ms": 20, **kw},
    )
    worker = Worker(settings, engine)
    task = asyncio.create_task(worker.run())
    await wait_for(lambda: worker.published >= expected or task.done(), 50, "all outcomes")
    worker.request_stop()
    await task


@pytest.fixture(scope="module")
async def decided(kafka_bootstrap: str, int8_engine) -> dict:
    """An input topic (2 partitions, 10 valid events + 1 invalid) decided by `prism run`'s worker."""
    tin, tout, tdlq = unique("rp-in"), unique("rp-out"), unique("rp-dlq")
    await create_topics(kafka_bootstrap, {tin: 2, tout: 1, tdlq: 1})
    evs = _events()
    msgs = [
        (e["event_id"].encode(), encode(e), i % 2, T0 + timedelta(hours=0 if i < 5 else 2))
        for i, e in enumerate(evs)
    ]
    msgs.append((b"bad", b'{"event_id": "rp-bad", "source": "alert"}', 1, T0 + timedelta(hours=2)))
    sent = await _produce_timed(kafka_bootstrap, tin, msgs)
    await _run_worker(kafka_bootstrap, int8_engine, tin, tout, tdlq, len(msgs))
    where = {e["event_id"]: (tin, md.partition, md.offset) for e, md in zip(evs, sent, strict=False)}
    return {"in": tin, "out": tout, "dlq": tdlq, "where": where}


@pytest.mark.kafka
async def test_replay_of_a_worker_topic_is_identical(
    kafka_bootstrap: str, decided: dict, int8_engine
) -> None:
    report = await replay(
        kafka_bootstrap, decided["out"], Selection(topic=decided["in"]), EngineSource(engines=[int8_engine])
    )
    assert report.ok, render_report(report)
    assert report.count("identical") == N_EVENTS == report.checked
    assert report.count("invalid") == 1 and report.count("different") == report.count("missing") == 0
    assert {o.event_id for o in report.outcomes if o.status == "identical"} == set(decided["where"])
    assert "RESULT: all identical" in render_report(report)


@pytest.mark.kafka
async def test_offset_and_time_ranges_select_the_right_events(
    kafka_bootstrap: str, decided: dict, int8_engine
) -> None:
    src = EngineSource(engines=[int8_engine])
    by_offset = await replay(
        kafka_bootstrap,
        decided["out"],
        Selection(topic=decided["in"], partitions=(0,), from_offset=1, to_offset=3),
        src,
    )
    assert [o.position for o in by_offset.outcomes] == [(decided["in"], 0, 1), (decided["in"], 0, 2)]
    assert by_offset.ok
    late = await replay(
        kafka_bootstrap,
        decided["out"],
        Selection(topic=decided["in"], from_time=T0 + timedelta(hours=1)),
        src,
    )
    # Events 5..9 and the invalid one were produced two hours after T0.
    expected = {f"rp-{i:04d}" for i in range(5, N_EVENTS)}
    assert {o.event_id for o in late.outcomes if o.status == "identical"} == expected
    assert late.count("invalid") == 1 and late.ok


@pytest.mark.kafka
async def test_tampered_probability_is_detected(kafka_bootstrap: str, decided: dict, int8_engine) -> None:
    # A copy of the decisions topic, plus a later copy of one record with one probability off by an ulp.
    copy = unique("rp-tampered")
    await create_topics(kafka_bootstrap, {copy: 1})
    originals = await read_all(kafka_bootstrap, [decided["out"]], N_EVENTS, settle=0.2)
    victim = next(m for m in originals if m.key == b"rp-0003")
    rec = orjson.loads(victim.value)
    old = rec["questions"]["sev"]["first"]["probabilities"][1]
    new = math.nextafter(old, 2.0)
    rec["questions"]["sev"]["first"]["probabilities"][1] = new
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        for m in originals:
            await producer.send_and_wait(copy, m.value, key=m.key, headers=list(m.headers or ()))
        await producer.send_and_wait(
            copy, orjson.dumps(rec), key=victim.key, headers=list(victim.headers or ())
        )
    finally:
        await producer.stop()

    report = await replay(
        kafka_bootstrap, copy, Selection(topic=decided["in"]), EngineSource(engines=[int8_engine])
    )
    assert not report.ok
    bad = [o for o in report.outcomes if o.status == "different"]
    assert [o.event_id for o in bad] == ["rp-0003"] and bad[0].copies == 2
    assert [d.path for d in bad[0].diffs] == ["questions.sev.first.probabilities[1]"]
    assert bad[0].diffs[0].recorded == new and bad[0].diffs[0].replayed == old
    text = render_report(report)
    assert new.hex() in text and old.hex() in text and "DIFFERENCES FOUND" in text
    assert report.count("identical") == N_EVENTS - 1


@pytest.mark.kafka
async def test_swapped_model_file_is_refused(kafka_bootstrap: str, decided: dict, other_model: Path) -> None:
    with pytest.raises(ReplayRefused, match="file sha256") as e:
        await replay(
            kafka_bootstrap, decided["out"], Selection(topic=decided["in"]), EngineSource([other_model])
        )
    assert str(other_model) in str(e.value)
    # The CLI refuses the same way, with a non-zero exit and the reason, before loading anything.
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable, "-m", "prism_pipeline.cli", "--log-json", "replay",
            "--brokers", kafka_bootstrap, "--records", decided["out"], "--topic", decided["in"],
            "--model", str(other_model),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to replay" in done.stderr and "file sha256" in done.stderr


@pytest.mark.kafka
async def test_other_precision_or_decision_config_is_refused(
    kafka_bootstrap: str, decided: dict, int8_engine, tiny_model: Path, tmp_path: Path
) -> None:
    sel = Selection(topic=decided["in"], partitions=(0,), to_offset=1)
    with pytest.raises(ReplayRefused, match="int8 path; replay was asked to use fp32"):
        await replay(
            kafka_bootstrap, decided["out"], sel, EngineSource(engines=[int8_engine], precision="fp32")
        )
    cfg = tmp_path / "decision_config.json"
    cfg.write_text(json.dumps({"temperatures": {"noul": 2.0}}))
    with pytest.raises(ReplayRefused, match="decision config sha256"):
        await replay(kafka_bootstrap, decided["out"], sel, EngineSource([tiny_model], decision_config=cfg))


@pytest.mark.kafka
async def test_event_id_selection_explain_and_publish(
    kafka_bootstrap: str, decided: dict, int8_engine
) -> None:
    republished = unique("rp-republished")
    await create_topics(kafka_bootstrap, {republished: 1})
    report = await replay(
        kafka_bootstrap,
        decided["out"],
        Selection(event_ids=(THINKER, "rp-0001", "no-such-event")),
        EngineSource(engines=[int8_engine]),
        publish=republished,
        explain_event=THINKER,
    )
    status = {o.event_id: o.status for o in report.outcomes}
    assert status == {THINKER: "identical", "rp-0001": "identical", "no-such-event": "missing"}
    assert not report.ok  # an asked-for event without a record is a failure
    assert report.published == 2
    again = {m.key: m.value for m in await read_all(kafka_bootstrap, [republished], 2, settle=0.2)}
    originals = {
        m.key: m.value for m in await read_all(kafka_bootstrap, [decided["out"]], N_EVENTS, settle=0.2)
    }
    assert again == {k: originals[k] for k in (THINKER.encode(), b"rp-0001")}

    text = report.explain or ""
    rec = orjson.loads(originals[THINKER.encode()])
    assert "replay: identical" in text
    assert (
        "<|im_start|>system\n" in text.replace("    │ ", "")
        and "Apply the criterion to the evidence." in text
    )
    assert "Question: Act now?" in text and "A) yes" in text and "B) no" in text
    trace = rec["questions"]["act"]
    assert trace["second"] is not None  # the gate-1.0 event thought, and the explanation shows it
    assert f"thought ({trace['thought_tokens']} tokens" in text and "second read-out" in text
    for logit in trace["first"]["rounds"][0]["logits"]:
        assert repr(logit) in text


@pytest.mark.kafka
async def test_reference_path_replays_in_the_workers_batches(kafka_bootstrap: str, tiny_engine) -> None:
    """fp32 is not batch invariant: replaying one event re-forms its batch from the headers."""
    tin, tout, tdlq = unique("rpf-in"), unique("rpf-out"), unique("rpf-dlq")
    await create_topics(kafka_bootstrap, {tin: 1, tout: 1, tdlq: 1})
    evs = [event(i, prefix="rpf") for i in range(6)]
    await _produce_timed(kafka_bootstrap, tin, [(None, encode(e), 0, T0) for e in evs])
    await _run_worker(
        kafka_bootstrap, tiny_engine, tin, tout, tdlq, len(evs), max_wait_ms=300, max_batch_events=3
    )
    sizes = [int(dict(m.headers)["prism-batch-events"]) for m in await read_all(kafka_bootstrap, [tout], 6)]
    assert max(sizes) > 1  # the worker batched events together, so batch shape matters
    report = await replay(
        kafka_bootstrap,
        tout,
        Selection(topic=tin, from_offset=4, to_offset=5),
        EngineSource(engines=[tiny_engine]),
    )
    assert [o.status for o in report.outcomes] == ["identical"], render_report(report)


@pytest.mark.kafka
@pytest.mark.slow
async def test_cli_replay_exit_code_and_explain(
    kafka_bootstrap: str, decided: dict, tiny_model: Path
) -> None:
    done = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable, "-m", "prism_pipeline.cli", "--log-json", "replay",
            "--brokers", kafka_bootstrap, "--records", decided["out"], "--topic", decided["in"],
            "--model", str(tiny_model), "--explain", "rp-0002",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RESULT: all identical" in done.stdout
    assert f"{N_EVENTS} identical" in done.stdout and "event rp-0002" in done.stdout
