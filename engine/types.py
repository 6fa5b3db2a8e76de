"""What goes into and comes out of `Engine.decide`.

Results reuse the wire contract's record pieces (`schemas.record`), so the pipeline turns a
result into a decision record without translating field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.record import QuestionTrace
from schemas.systemone import Answer, SystemOneRequest


@dataclass(frozen=True)
class DecideRequest:
    request_id: str  # the event id (thought draws are keyed by content and `seed`, not by it)
    request: SystemOneRequest
    seed: int = 0
    gate: float | None = None  # event-level AutoThink gate; a question's own gate wins
    thought_budget: int | None = None


@dataclass
class DecideResult:
    request_id: str
    answers: dict[str, Answer]
    traces: dict[str, QuestionTrace]
    input_tokens: int  # prompt tokens over all questions (as if each were its own prompt)
    output_tokens: int  # thought tokens generated
    timings: dict[str, float] = field(default_factory=dict)  # seconds; run metadata, never in records
    error: str | None = None  # set when the engine cannot answer the request (answers then empty)
