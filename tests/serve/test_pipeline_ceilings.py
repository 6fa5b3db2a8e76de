"""The same ceilings in `prism run` (the worker's event preparation) and `backfill` (a chunk).

A poison event cannot think past the operator's budget, a capped gate holds, and a state nested
too deep is dead-lettered with its reason (the HTTP server answers the same body with 422).
"""

from __future__ import annotations

import orjson

from engine.engine import Engine
from engine.types import DecideRequest
from prism_pipeline.core.ceilings import MAX_STATE_DEPTH
from prism_pipeline.offline.backfill import BackfillOptions, decide_chunk
from prism_pipeline.offline.sources import Item
from prism_pipeline.worker.loop import Worker
from prism_pipeline.worker.settings import WorkerSettings
from schemas.deadletter import InvalidEvent, ReasonCode


def _event(event_id: str, state: bytes = b'"disk full on db-3"', **extra: object) -> bytes:
    head = {
        "event_id": event_id,
        "source": "alert",
        "tenant": "acme",
        "created_at": "2026-11-28T08:00:00Z",
        **extra,
    }
    questions = b'{"q": {"type": "noul", "gate": 1}, "r": {"type": "noul"}}'
    return (
        orjson.dumps(head)[:-1] + b', "request": {"state": ' + state + b', "questions": ' + questions + b"}}"
    )


DEEP = b"[" * (MAX_STATE_DEPTH + 1) + b'"x"' + b"]" * (MAX_STATE_DEPTH + 1)


def test_the_worker_caps_events_and_dead_letters_deep_states(engine: Engine) -> None:
    budget = engine.decision_config.thought_budget
    worker = Worker(WorkerSettings(max_gate=0.5), engine)
    poison, deep = worker._prepare([_event("poison", gate=1.0, thought_budget=65536), _event("deep", DEEP)])
    assert isinstance(deep, InvalidEvent) and deep.reason == ReasonCode.schema_violation
    assert str(MAX_STATE_DEPTH) in deep.message
    assert not isinstance(poison, InvalidEvent)
    request = poison.request
    assert isinstance(request, DecideRequest) and request.max_gate == 0.5
    result = engine.decide([request])[0]
    for trace in result.traces.values():
        assert trace.thought_tokens <= budget


def test_backfill_caps_the_budget_and_the_gate(engine: Engine) -> None:
    budget = engine.decision_config.thought_budget
    items = [
        Item(_event("poison", gate=1.0, thought_budget=65536), "f", 0, 0),
        Item(_event("deep", DEEP), "f", 0, 1),
    ]
    out = decide_chunk(engine, items, BackfillOptions())
    assert len(out.records) == 1 and len(out.dead) == 1
    assert out.reasons == {"schema_violation": 1}
    assert str(MAX_STATE_DEPTH).encode() in out.dead[0]
    record = orjson.loads(out.records[0].value)
    assert record["questions"]["q"]["thought_tokens"] <= budget  # 65,536 asked, the config's budget given
    assert record["questions"]["q"]["second"] is not None  # the event's gate 1 stands without max_gate
    capped = decide_chunk(engine, items[:1], BackfillOptions(max_gate=0.0))
    assert orjson.loads(capped.records[0].value)["questions"]["q"]["second"] is None
