"""What goes into and comes out of `Engine.decide`.

Results reuse the wire contract's record pieces (`schemas.record`), so the pipeline turns a
result into a decision record without translating field by field.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from schemas.record import QuestionTrace
from schemas.systemone import Answer, SystemOneRequest

StopReason = Literal["deadline", "cancelled"]
# A `DecideResult.error` caused by an image starts with this (the pipeline dead-letters the event
# as invalid_image, the server answers 422 invalid_image).
INVALID_IMAGE = "invalid_image"


class ImageError(ValueError):
    """An image that cannot be used (corrupt, truncated, too large, another format); the message
    names the image and the reason. Defined here, not in `engine.vision`, so the pipeline can
    catch it without importing the tower's dependencies."""


class CancelToken:
    """Set from another thread (the HTTP event loop) to stop a request's thoughts in the engine.

    The engine polls it between thought steps, so a disconnected client or a server draining for
    SIGTERM frees the engine within one step. It does not travel to tensor-parallel followers
    (pickling gives a fresh, unset token): rank 0 decides which thoughts stop and broadcasts that,
    because every rank must run the same steps.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def __reduce__(self) -> tuple[type[CancelToken], tuple[()]]:
        return (CancelToken, ())


@dataclass(frozen=True)
class DecideRequest:
    request_id: str  # the event id (thought draws are keyed by content and `seed`, not by it)
    request: SystemOneRequest
    seed: int = 0
    gate: float | None = None  # event-level AutoThink gate; a question's own gate wins
    thought_budget: int | None = None
    # Operator ceilings: whatever the event or a question asks for, the engine uses at most these.
    max_gate: float | None = None  # a question's or event's gate above it is lowered to it
    max_thought_budget: int | None = None
    # Stops that cut the request's thoughts (results then carry `stopped`): a `time.monotonic()`
    # deadline and a token the caller sets when nobody waits for the answer any more.
    deadline: float | None = None
    cancel: CancelToken | None = None

    def stop_reason(self) -> StopReason | None:
        """Why this request's work should stop now, or None (cheap: polled every thought step)."""
        if self.cancel is not None and self.cancel.is_set():
            return "cancelled"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "deadline"
        return None


@dataclass
class DecideResult:
    request_id: str
    answers: dict[str, Answer]
    traces: dict[str, QuestionTrace]
    input_tokens: int  # prompt tokens over all questions (as if each were its own prompt)
    output_tokens: int  # thought tokens generated
    timings: dict[str, float] = field(default_factory=dict)  # seconds; run metadata, never in records
    error: str | None = None  # set when the engine cannot answer the request (answers then empty)
    # Set when a deadline or cancellation cut a thought of this request: its answers then fall back
    # to the first read-out for the cut questions, which depends on timing, so callers must not
    # publish it as a decision (HTTP answers 504, the worker dead-letters the event).
    stopped: StopReason | None = None
    # The sampled thought tokens per question that thought (the trace holds their decoded text,
    # which need not re-encode to the same tokens): what `Engine.read_with_thought` takes back.
    thought_ids: dict[str, list[int]] = field(default_factory=dict)
