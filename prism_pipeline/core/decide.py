"""The one decision step: raw event bytes in, a decision record or a dead letter out.

Every path that turns events into records — the Kafka worker (`prism run`), `prism backfill`,
`prism replay`, the demo's verify — goes through these three functions, in this order:

1. `prepare`: parse and validate the event (schema, limits, state depth), build its engine request
   (seed policy, the operator's gate ceiling) and count its tokens (a corrupt image or a state the
   engine cannot render is refused here, before any batch sees it);
2. `decide_batch`: one engine call for the batch; if it raises, each event is decided alone, so one
   poison event cannot take its batch-mates down (the one "retry alone" rule; the HTTP server's
   dispatcher uses it too);
3. `settle`: pair a result with its event and build the record, or the dead letter when the engine
   failed or returned an answer the record contract refuses.

Replay equality rests on these being the same code everywhere: a record is a pure function of what
`prepare` read and what the engine answered. Nothing here knows Kafka, HTTP or files; `Origin` is
where the input came from, for the dead letter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from engine.types import DecideRequest, DecideResult, ImageError
from prism_pipeline.core.ceilings import Ceilings, too_deep
from prism_pipeline.core.records import DecisionEngine, build_record, decide_request, engine_dead_letter
from prism_pipeline.core.seeds import SeedPolicy
from schemas.deadletter import DeadLetter, InvalidEvent, ReasonCode, parse_event
from schemas.event import EvidenceEvent
from schemas.record import DecisionRecord, InputRef, Provenance
from schemas.systemone import Limits

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DecisionRules:
    """What turns an event into an engine request, the same under every command (and what a replay
    must be given again to reproduce a record)."""

    limits: Limits | None = None
    seed_policy: SeedPolicy = "event"
    fixed_seed: int = 0
    max_gate: float | None = None  # the highest gate an event or question may ask for (None: any)


@dataclass(frozen=True)
class Origin:
    """Where one input came from, as a dead letter names it (file input: path, file index, line)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None = None

    def where(self) -> dict[str, Any]:
        """The dead letter's position fields."""
        return {"topic": self.topic, "partition": self.partition, "offset": self.offset, "key": self.key}

    def dead_letter(
        self, raw: bytes, invalid: InvalidEvent, max_original_bytes: int | None = None
    ) -> DeadLetter:
        """The dead letter of an input `prepare` refused."""
        return invalid.to_dead_letter(raw, **self.where(), max_original_bytes=max_original_bytes)


@dataclass(frozen=True)
class Prepared:
    """A valid event, its engine request and its token count."""

    event: EvidenceEvent
    request: DecideRequest
    tokens: int


def prepare(raw: bytes, engine: DecisionEngine, rules: DecisionRules) -> Prepared | InvalidEvent:
    """Step 1: the event's engine request, or why it cannot have one (a dead letter's reason)."""
    try:
        event = parse_event(raw, rules.limits)
    except InvalidEvent as e:
        return e
    deep = too_deep(event.request.state)
    if deep is not None:  # every path must refuse it alike (the HTTP server answers 422)
        return InvalidEvent(ReasonCode.schema_violation, deep)
    request = decide_request(event, rules.seed_policy, rules.fixed_seed)
    if rules.max_gate is not None:
        request = Ceilings(max_gate=rules.max_gate).apply(request)
    try:
        tokens = engine.count_tokens(event.request)
    except ImageError as e:  # corrupt, oversized or hostile: checked before any batch sees it
        return InvalidEvent(ReasonCode.invalid_image, str(e)[:2000])
    except Exception as e:  # valid by the contract, yet the engine cannot render it
        return InvalidEvent(
            ReasonCode.engine_rejected, f"engine cannot tokenize it: {type(e).__name__}: {e}"[:2000]
        )
    return Prepared(event, request, tokens)


@dataclass(frozen=True)
class Decided:
    """What `decide_batch` got: one result (or the exception) per request, in request order."""

    results: list[DecideResult | Exception]
    alone: bool  # the batch failed and each request was decided on its own
    seconds: list[float]  # per request: the engine call that decided it


def decide_batch(
    decide: Callable[..., Sequence[DecideResult]], requests: list[DecideRequest], **kw: Any
) -> Decided:
    """Step 2: one engine call for `requests`; if it raises (or miscounts), each request alone.

    A batch of one is not retried: deciding it alone is what just failed. `kw` goes to the batch
    call only (the HTTP server's early delivery and side runs), not to the calls alone.
    """
    t0 = time.monotonic()
    try:
        results = list(decide(requests, **kw))
        if len(results) != len(requests):
            raise RuntimeError(f"engine returned {len(results)} results for {len(requests)} requests")
        seconds = time.monotonic() - t0
        return Decided(list(results), False, [seconds] * len(requests))
    except Exception as e:
        if len(requests) == 1:
            return Decided([e], False, [time.monotonic() - t0])
        log.warning("engine.batch_failed", events=len(requests), error=f"{type(e).__name__}: {e}")
    out: list[DecideResult | Exception] = []
    took: list[float] = []
    for r in requests:
        t1 = time.monotonic()
        try:
            out.append(decide([r])[0])
        except Exception as e1:
            out.append(e1)
        took.append(time.monotonic() - t1)
    return Decided(out, True, took)


def settle(
    raw: bytes,
    prepared: Prepared,
    result: DecideResult | BaseException,
    model: Provenance,
    origin: Origin,
    *,
    source: InputRef | None,
    max_original_bytes: int | None = None,
) -> DecisionRecord | DeadLetter:
    """Step 3: the record of a decided event, or its dead letter (an engine failure, an error result,
    or an answer the record contract refuses)."""
    if isinstance(result, DecideResult) and result.error is not None:
        result = RuntimeError(result.error)
    if isinstance(result, DecideResult):
        try:
            return build_record(prepared.event, prepared.request, result, model, source)
        except Exception as e:  # an engine answer the contract refuses is an engine failure
            result = e
    log.warning(
        "event.engine_rejected",
        event_id=prepared.event.event_id,
        error=f"{type(result).__name__}: {result}",
    )
    return engine_dead_letter(raw, result, **origin.where(), max_original_bytes=max_original_bytes)
