"""`prism demo`: the whole pipeline on one machine, end to end.

Starts the local Kafka broker, takes the bundled trained demo model (or `--model`), creates topics,
publishes the bundled sample alerts and tickets, runs one worker until every event has its
outcome, reads the decision records back, re-decides them and compares bytes, and shuts down.
The CLI prints the result; this module only computes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from prism_pipeline.core.records import DecisionEngine
from prism_pipeline.local_kafka import LocalKafka, LocalKafkaError, TopicSpec
from prism_pipeline.offline.verify import PublishedRecord, redecide
from prism_pipeline.worker.loop import Worker, WorkerError
from prism_pipeline.worker.settings import WorkerSettings
from schemas.codec import loads
from schemas.deadletter import parse_event
from schemas.record import DecisionRecord

log = structlog.get_logger(__name__)

DEMO_MODEL_FILE = "prism-demo-aiops-q8_0.gguf"
INPUT_PARTITIONS = 3


class DemoError(RuntimeError):
    """The demo could not run; the message says which step failed."""


@dataclass
class DemoResult:
    events: int
    records: list[DecisionRecord] = field(default_factory=list)  # in input order
    dead_letters: int = 0
    pipeline_seconds: float = 0.0
    model_name: str = ""
    model_digest: str = ""
    precision: str = ""
    replay_mismatches: list[str] = field(default_factory=list)


def sample_events_path() -> Path:
    return Path(str(resources.files("prism_pipeline") / "data" / "sample_events.jsonl"))


def bundled_model_path() -> Path:
    return Path(str(resources.files("prism_pipeline") / "data" / DEMO_MODEL_FILE))


def demo_model(cache_dir: Path) -> Path:
    """The trained demo decision model: the bundled file (`ops/train/train_demo_model.py` made it;
    README "The demo model"), or, when a checkout lacks it, the same file rebuilt into
    `cache_dir` by the same deterministic command (`RECIPE`: one run, about 12 minutes on a core)."""
    bundled = bundled_model_path()
    if bundled.is_file():
        return bundled
    path = cache_dir / "models" / DEMO_MODEL_FILE
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("demo.training_model", path=str(path), note="the bundled model is missing; training it once")
    try:
        from ops.train.train_demo_model import RECIPE
    except ImportError as e:
        raise DemoError(
            f"the bundled demo model is missing and its training script cannot be imported ({e}): "
            "run from the repository root, or pass --model"
        ) from None

    tmp = path.with_suffix(".tmp")
    prev = ""
    for i, stage in enumerate(RECIPE):
        nxt = str(tmp) if i == len(RECIPE) - 1 else str(path.with_suffix(f".stage{i + 1}"))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ops.train.train_demo_model",
                *(a.format(prev=prev, next=nxt) for a in stage),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise DemoError(f"training the demo model failed:\n{done.stderr[-2000:]}")
        prev = nxt
    tmp.replace(path)
    return path


def read_events(path: Path, limit: int | None) -> list[bytes]:
    try:
        lines = [ln for ln in path.read_bytes().splitlines() if ln.strip()]
    except OSError as e:
        raise DemoError(f"cannot read events from {path}: {e}") from None
    return lines[:limit] if limit is not None else lines


@contextlib.asynccontextmanager
async def local_broker() -> AsyncIterator[LocalKafka]:
    """A fresh local Kafka broker (temp work dir) for the demo's lifetime."""
    broker = LocalKafka()
    try:
        await asyncio.to_thread(broker.start)
    except LocalKafkaError as e:
        raise DemoError(f"starting the local Kafka broker failed: {e}") from None
    try:
        yield broker
    finally:
        await asyncio.to_thread(broker.stop)


async def _publish(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for v in values:
            key = None
            with contextlib.suppress(Exception):
                key = parse_event(v).event_id.encode()
            await producer.send(topic, v, key=key)
        await producer.flush()
    finally:
        await producer.stop()


async def _read(bootstrap: str, topics: list[str], expected: int, timeout: float = 60.0) -> list:
    """The first `expected` messages of `topics` as the worker writes them: a live tail while the
    outputs still arrive, not a read of known offsets (`offline.kafka_range` does those)."""
    consumer = AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    out: list = []
    try:
        deadline = time.monotonic() + timeout
        while len(out) < expected and time.monotonic() < deadline:
            for msgs in (await consumer.getmany(timeout_ms=200)).values():
                out.extend(msgs)
    finally:
        await consumer.stop()
    return out


async def _run(engine: DecisionEngine, events: list[bytes], timeout: float) -> DemoResult:
    run = uuid.uuid4().hex[:8]
    tin, tout, tdlq = f"prism.evidence.{run}", f"prism.decisions.{run}", f"prism.dead-letters.{run}"
    result = DemoResult(
        events=len(events),
        model_name=engine.model_name,
        model_digest=engine.model_digest,
        precision=engine.precision,
    )
    async with local_broker() as broker:
        bootstrap = broker.bootstrap
        await broker.create_topics(
            [
                TopicSpec(tin, INPUT_PARTITIONS),
                TopicSpec(tout, 1, compact=True),  # one record per event id survives redelivery
                TopicSpec(tdlq, 1),
            ]
        )
        await _publish(bootstrap, tin, events)
        settings = WorkerSettings(
            brokers=bootstrap,
            input_topic=tin,
            output_topic=tout,
            dlq_topic=tdlq,
            group_id=f"prism-demo-{run}",
            worker_id=f"demo-{run}",
        )
        worker = Worker(settings, engine)
        t0 = time.monotonic()
        task = asyncio.create_task(worker.run())
        deadline = t0 + timeout
        next_report = t0 + 5.0
        while worker.published < len(events) and not task.done():
            if time.monotonic() >= next_report:
                if worker.published == 0:
                    # The first batch is the long one: the engine's first forest pass, and any
                    # AutoThink thoughts (engine.thinking lines show them).
                    log.info(
                        "demo.waiting_for_first_batch",
                        events=len(events),
                        seconds=round(time.monotonic() - t0),
                    )
                else:
                    log.info("demo.progress", decided=worker.published, events=len(events))
                next_report += 5.0
            if time.monotonic() > deadline:
                worker.request_stop()
                await task
                raise DemoError(f"only {worker.published} of {len(events)} events decided in {timeout:.0f} s")
            await asyncio.sleep(0.05)
        result.pipeline_seconds = time.monotonic() - t0
        worker.request_stop()
        await task  # a publishing failure surfaces here as WorkerError

        outputs = await _read(bootstrap, [tout, tdlq], len(events))
        inputs = {(m.partition, m.offset): m.value for m in await _read(bootstrap, [tin], len(events))}
        published: list[PublishedRecord] = []
        records: list[DecisionRecord] = []
        for m in outputs:
            if m.topic == tdlq:
                result.dead_letters += 1
                continue
            rec = loads(m.value, DecisionRecord)
            records.append(rec)
            h = dict(m.headers or ())
            published.append(
                PublishedRecord(
                    value=m.value,
                    event_raw=inputs[(rec.input.partition, rec.input.offset)],
                    input=rec.input,
                    batch=h["prism-batch"].decode(),
                    batch_pos=int(h["prism-batch-pos"]),
                )
            )
        order = {raw: i for i, raw in enumerate(events)}
        records.sort(key=lambda r: order.get(inputs[(r.input.partition, r.input.offset)], 0))
        result.records = records
        log.info("demo.replaying", records=len(published))

        def replayed(done: int, total: int) -> None:
            log.info("demo.replay_progress", re_decided=done, records=total)

        result.replay_mismatches = await asyncio.to_thread(redecide, engine, published, progress=replayed)
    return result


def run_demo(
    *,
    model: Path | None = None,
    events: Path | None = None,
    cache_dir: Path = Path(".cache"),
    device: str = "cpu",
    precision: str = "auto",
    limit: int | None = None,
    gate: float | None = None,
    thought_budget: int | None = None,
    timeout: float = 900.0,
) -> DemoResult:
    """Run the demo end to end; raises DemoError with the failing step."""
    from prism_pipeline.core.engine_setup import ConfigError, EngineSettings, load_engine

    cache_dir = cache_dir.resolve()
    raw = read_events(events or sample_events_path(), limit)
    if not raw:
        raise DemoError("no events to publish")
    model_path = model if model is not None else demo_model(cache_dir)
    settings = EngineSettings(
        model=model_path,
        device=device,
        precision=precision,
        gate=gate,
        thought_budget=thought_budget,  # type: ignore[arg-type]
    )
    try:
        engine = load_engine(settings)
    except ConfigError as e:
        raise DemoError(str(e)) from None
    try:
        return asyncio.run(_run(engine, raw, timeout))
    except (WorkerError, LocalKafkaError) as e:
        raise DemoError(str(e)) from None
