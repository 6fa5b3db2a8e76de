"""A cancelled request's thought leaves the decoder loop; its companions keep their bits."""

from __future__ import annotations

from engine.engine import Engine
from engine.types import CancelToken, DecideRequest
from schemas.systemone import SystemOneRequest

CRITERIA = {"dba": None, "sre": None, "net": None}
QUESTION = {"type": "choice", "instructions": "Which team?", "criteria": CRITERIA}


class _CancelAfter(CancelToken):
    """Set after `polls` looks: a client that leaves mid-thought, at a reproducible step."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls

    def is_set(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def _req(event_id: str, state: str, cancel: CancelToken | None = None) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": {"q": QUESTION}})
    return DecideRequest(event_id, body, seed=1, gate=1.0, thought_budget=6, cancel=cancel)


def test_a_cancelled_thought_leaves_the_decoder_and_its_companions_bits(decoder_engine: Engine) -> None:
    engine = decoder_engine
    other = _req("b", "api latency 900ms on checkout")
    alone = engine.decide([other])[0]
    cut, together = engine.decide([_req("a", "disk 97% on db-3", _CancelAfter(2)), other])
    assert alone.traces["q"].thought_tokens > 2
    assert cut.stopped == "cancelled" and together.stopped is None
    assert cut.traces["q"].second is None and cut.traces["q"].thought_tokens <= 2
    assert together.traces == alone.traces and together.answers == alone.answers


def test_work_between_decoder_steps_changes_no_bits(decoder_engine: Engine) -> None:
    """A nested decide (no thought) between decoder steps: on CUDA a body/executor pass between
    graph replays; neither the thought nor the nested answer changes a bit."""
    engine = decoder_engine
    thinker = _req("a", "disk 97% on db-3")
    body = SystemOneRequest.model_validate({"state": "ok", "questions": {"q": QUESTION}})
    short = DecideRequest("b", body, gate=0.0)  # work between steps must not think
    alone = engine.decide([thinker])[0]
    alone_short = engine.decide([short])[0]
    nested: list = []
    mixed = engine.decide([thinker], between_steps=lambda: nested.extend(engine.decide([short])))[0]
    assert len(nested) > 2
    assert mixed.traces == alone.traces and mixed.answers == alone.answers
    assert all(n.traces == alone_short.traces and n.answers == alone_short.answers for n in nested)
