"""Turning engine results and rejected input into the Kafka messages the worker publishes.

The record value is the canonical encoding of a DecisionRecord built only from the event, the
engine's provenance (model digest, precision path, decision config), the seed and the input
position; run metadata (worker id, attempt, timings) goes into headers. Building is a pure
function, which is what lets `prism demo` (and later `prism replay`) compare bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from engine.types import DecideRequest, DecideResult
from prism_pipeline.core.seeds import SeedPolicy, choose_seed
from schemas.codec import dumps
from schemas.deadletter import DeadLetter, ReasonCode, dead_letter
from schemas.event import EvidenceEvent
from schemas.record import DecisionRecord, InputRef, Provenance, record_key
from schemas.systemone import SystemOneRequest, Usage

RECORD_VERSION = 1
# Original bytes kept in a dead letter: base64 (x4/3) plus the envelope must stay under the
# producer's 1 MiB request cap, or one oversized poison message would fail the worker forever.
MAX_DEAD_LETTER_ORIGINAL_BYTES = 256 * 1024
Header = tuple[str, bytes]


class DecisionConfigLike(Protocol):
    gate: float
    thought_budget: int
    second_weight: float

    def digest(self) -> str: ...


class DecisionEngine(Protocol):
    """What the pipeline needs from `engine.Engine` (structural, so tests and tools can pass one)."""

    model_name: str
    model_digest: str
    precision: str
    engine_version: str
    render_version: str
    decision_config: DecisionConfigLike

    def decide(self, requests: list[DecideRequest]) -> list[DecideResult]: ...

    def count_tokens(self, request: SystemOneRequest) -> int: ...


def provenance(engine: DecisionEngine) -> Provenance:
    cfg = engine.decision_config
    return Provenance(
        name=engine.model_name,
        file_digest=engine.model_digest,
        engine_version=engine.engine_version,
        precision=engine.precision,  # type: ignore[arg-type]
        render_version=engine.render_version,
        decision_config_digest=cfg.digest(),
        gate=cfg.gate,
        thought_budget=cfg.thought_budget,
        mix_weight=cfg.second_weight,
    )


def decide_request(
    event: EvidenceEvent, seed_policy: SeedPolicy = "event", fixed_seed: int = 0
) -> DecideRequest:
    """The engine request for an event: its SystemOne request, seed, and event-level overrides."""
    return DecideRequest(
        request_id=event.event_id,
        request=event.request,
        seed=choose_seed(seed_policy, event.event_id, event.seed, fixed_seed),
        gate=event.gate,
        thought_budget=event.thought_budget,
    )


def build_record(
    event: EvidenceEvent,
    request: DecideRequest,
    result: DecideResult,
    model: Provenance,
    source: InputRef | None,
) -> DecisionRecord:
    if result.request_id != event.event_id:
        raise ValueError(f"engine result for {result.request_id!r} paired with event {event.event_id!r}")
    qids = list(event.request.questions)
    missing = [q for q in qids if q not in result.answers or q not in result.traces]
    if missing:
        raise ValueError(f"engine result for {event.event_id!r} lacks questions {missing}")
    return DecisionRecord(
        record_version=RECORD_VERSION,
        event_id=event.event_id,
        source=event.source,
        tenant=event.tenant,
        created_at=event.created_at,
        model=model,
        seed=request.seed,
        # Question order is the event's: the record is then independent of engine dict order.
        answers={q: result.answers[q] for q in qids},
        questions={q: result.traces[q] for q in qids},
        usage=Usage(input_tokens=result.input_tokens, output_tokens=result.output_tokens),
        input=source,
    )


@dataclass
class Outgoing:
    """One message to publish: a decision record or a dead letter, for one input offset."""

    kind: Literal["record", "dead_letter"]
    topic: str
    key: bytes | None
    value: bytes
    headers: list[Header] = field(default_factory=list)
    event_id: str | None = None
    reason: str | None = None  # dead letters only
    thought: int = 0  # questions that went through AutoThink (records only)
    questions: int = 0


def run_headers(worker_id: str, attempt: int, timings: dict[str, float] | None = None) -> list[Header]:
    """Run metadata: never part of the value, so replays compare equal."""
    headers = [("prism-worker", worker_id.encode()), ("prism-attempt", str(attempt).encode())]
    for name, seconds in sorted((timings or {}).items()):
        headers.append((f"prism-t-{name}-ms", f"{seconds * 1000:.3f}".encode()))
    return headers


def batch_headers(batch: str, position: int, size: int) -> list[Header]:
    """Which engine call decided a record, with whom: a replay of a path that is not batch invariant
    (fp32/bf16) re-forms the same batches from these to compare bytes (`core.batching.recorded_batches`)."""
    return [
        ("prism-batch", batch.encode()),
        ("prism-batch-pos", str(position).encode()),
        ("prism-batch-events", str(size).encode()),
    ]


def record_message(record: DecisionRecord, topic: str, headers: list[Header]) -> Outgoing:
    thought = sum(1 for t in record.questions.values() if t.second is not None)
    return Outgoing(
        kind="record",
        topic=topic,
        key=record_key(record.event_id),
        value=dumps(record),
        headers=headers,
        event_id=record.event_id,
        thought=thought,
        questions=len(record.questions),
    )


def dead_letter_message(letter: DeadLetter, topic: str, key: bytes | None, headers: list[Header]) -> Outgoing:
    # Keyed like the input message so a compacted dead-letter topic keeps one entry per input key.
    return Outgoing(
        kind="dead_letter",
        topic=topic,
        key=key,
        value=dumps(letter),
        headers=[*headers, ("prism-reason", str(letter.reason).encode())],
        reason=str(letter.reason),
    )


def engine_dead_letter(
    raw: bytes,
    error: BaseException,
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None,
    max_original_bytes: int | None = None,
) -> DeadLetter:
    """A valid event the engine could not decide (after a retry on its own)."""
    return dead_letter(
        raw,
        ReasonCode.engine_rejected,
        f"engine failed on this event: {type(error).__name__}: {error}"[:2000],
        topic=topic,
        partition=partition,
        offset=offset,
        key=key,
        max_original_bytes=max_original_bytes,
    )
