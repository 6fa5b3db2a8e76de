"""`prism run` decides events with images end to end (a real broker, the worker as a subprocess,
the projector given with `--mmproj`), and dead-letters hostile images as `invalid_image` with
the reason, never crashing: truncated, a 30,000 x 30,000 header, a zip-bomb PNG, wrong base64."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from engine.decide.decision_config import DecisionConfig
from engine.testing.images import b64, huge_header_png, random_image, truncated, zip_bomb_png
from engine.testing.make_model import DIMS, make_mmproj, make_model
from prism_pipeline.offline.engines import EngineSource
from prism_pipeline.offline.replay import replay
from prism_pipeline.offline.report import render_report
from prism_pipeline.offline.selection import Selection
from prism_pipeline.offline.verify import PublishedRecord, redecide
from schemas.codec import loads
from schemas.deadletter import DeadLetter, ReasonCode
from schemas.record import DecisionRecord
from tests.pipeline.kafkautil import (
    Tail,
    create_topics,
    encode,
    event,
    headers,
    produce,
    read_all,
    spawn_worker,
    stop_worker,
    unique,
    wait_for,
)

pytestmark = pytest.mark.kafka

GATE, BUDGET = 0.0, 3


@pytest.fixture(scope="module")
def vision_files(module_tmp_path: Path) -> tuple[Path, Path]:
    root = module_tmp_path
    model = make_model(root / "tiny-q8_0.gguf", "Q8_0", "tiny", 0)
    # not named mmproj-*: the worker must take it from --mmproj, not find it
    return model, make_mmproj(root / "projector.gguf", DIMS["tiny"], 0)


def _with_images(i: int, images: list[str]) -> dict:
    e = event(i, prefix="img")
    e["request"]["images"] = images
    return e


async def test_prism_run_decides_images_and_dead_letters_hostile_ones(
    kafka_bootstrap: str, vision_files: tuple[Path, Path], tmp_path: Path
) -> None:
    from engine.engine import Engine

    model, mmproj = vision_files
    good = [
        _with_images(0, [b64(random_image(120, 200, seed=1)), b64(random_image(60, 90, fmt="JPEG", seed=2))]),
        _with_images(1, [b64(random_image(300, 300, fmt="WEBP", seed=3))]),
        event(2, prefix="img"),  # text only, beside the images
    ]
    bad = {
        "img-0010": (
            _with_images(10, [b64(truncated(random_image(200, 200, seed=4)))]),
            "corrupt or truncated",
        ),
        "img-0011": (_with_images(11, [b64(huge_header_png())]), "too large to decode safely"),
        "img-0012": (_with_images(12, [b64(zip_bomb_png())]), "more than the limit"),
        "img-0013": (_with_images(13, ["bm90IGFuIGltYWdl!!!!"]), "not valid base64"),
    }
    events = good + [e for e, _ in bad.values()]
    tin, tout, tdlq = unique("in"), unique("out"), unique("dlq")
    await create_topics(kafka_bootstrap, {tin: 1, tout: 1, tdlq: 1})
    await produce(kafka_bootstrap, tin, [(e["event_id"].encode(), encode(e), 0) for e in events])
    args = [
        *("--brokers", kafka_bootstrap, "--input-topic", tin, "--output-topic", tout, "--dlq-topic", tdlq),
        *("--group-id", unique("g"), "--model", str(model), "--mmproj", str(mmproj)),
        *("--device", "cpu", "--precision", "fp32", "--gate", str(GATE), "--thought-budget", str(BUDGET)),
        # fp32 is not batch invariant: one event per batch, so the re-decision below is byte-equal
        *("--max-batch-events", "1", "--max-wait-ms", "5"),
    ]
    log = tmp_path / "worker.log"
    async with Tail(kafka_bootstrap, [tout, tdlq]) as out:
        worker = spawn_worker(args, log)
        try:
            await wait_for(
                lambda: len(out.messages) >= len(events) or worker.poll() is not None, 120, "every event"
            )
            assert worker.poll() is None, log.read_text()[-3000:]
        finally:
            assert stop_worker(worker, signal.SIGTERM) == 0, log.read_text()[-3000:]
        await asyncio.sleep(0.3)

    records = {m.key.decode(): m for m in out.messages if m.topic == tout}
    letters = {m.key.decode(): loads(m.value, DeadLetter) for m in out.messages if m.topic == tdlq}
    assert set(records) == {e["event_id"] for e in good}
    assert set(letters) == set(bad)
    for key, (_, reason) in bad.items():
        assert letters[key].reason == ReasonCode.invalid_image, letters[key]
        assert reason in letters[key].message, letters[key].message

    # the records are what this engine decides for the same events (byte for byte)
    engine = Engine.load(
        model,
        precision="fp32",
        decision_config=DecisionConfig(gate=GATE, thought_budget=BUDGET),
        mmproj=mmproj,
    )
    raw = {m.offset: m.value for m in await read_all(kafka_bootstrap, [tin], len(events), settle=0)}
    published = []
    for m in records.values():
        rec = loads(m.value, DecisionRecord)
        assert rec.model.file_digest == engine.model_digest
        assert list(rec.answers) == list(good[0]["request"]["questions"])
        published.append(
            PublishedRecord(
                value=m.value,
                event_raw=raw[rec.input.offset],
                input=rec.input,
                batch=headers(m)["prism-batch"].decode(),
                batch_pos=int(headers(m)["prism-batch-pos"]),
            )
        )
    assert redecide(engine, published) == []
    # and the images were seen: without them the first event's record differs
    text_only = [p for p in published if loads(p.value, DecisionRecord).event_id == "img-0000"]
    stripped = [
        PublishedRecord(
            value=p.value,
            event_raw=encode(
                {**good[0], "request": {k: v for k, v in good[0]["request"].items() if k != "images"}}
            ),
            input=p.input,
            batch=p.batch,
            batch_pos=p.batch_pos,
        )
        for p in text_only
    ]
    assert redecide(engine, stripped) == ["img-0000"]

    # `prism replay`'s engine source finds the projector beside the model (llama.cpp's naming) and
    # matches the records' digest of both files: every image record is identical again
    (model.parent / "mmproj-tiny-q8_0.gguf").symlink_to(mmproj)
    report = await replay(kafka_bootstrap, tout, Selection(topic=tin), EngineSource([model]))
    assert report.ok, render_report(report)
    assert report.count("identical") == len(good)
    # wrong base64 fails the schema; the others are refused again by the engine, for the same reason
    assert report.count("invalid") == 1 and report.count("rejected") == len(bad) - 1
    assert all("invalid_image" in o.note for o in report.outcomes if o.status == "rejected")
