"""Deadlines and cancellation under tensor parallelism: rank 0 decides, every rank runs the same
steps (a follower deciding alone would desynchronize the collectives and hang), and the answers
equal one process's."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.types import CancelToken, DecideRequest
from schemas.systemone import SystemOneRequest

CRITERIA = {"dba": None, "sre": None, "net": None}
QUESTION = {"type": "choice", "instructions": "Which team?", "criteria": CRITERIA}


class _CancelAfter(CancelToken):
    """Set after `polls` looks (on rank 0 only: a follower unpickles a plain, unset token)."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls

    def is_set(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def _req(event_id: str, state: str, **kw: object) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": {"q": QUESTION}})
    return DecideRequest(event_id, body, seed=1, gate=1.0, thought_budget=6, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def q8_model(gguf_model: Callable[..., Path]) -> Path:
    return gguf_model("Q8_0", "tiny", seed=3)


def test_two_ranks_stop_the_thoughts_rank_zero_stops(q8_model: Path) -> None:
    other = _req("b", "api latency 900ms on checkout")
    alone = Engine.load(q8_model, precision="int8").decide([other])[0]
    two = Engine.load(q8_model, precision="int8", tp=2)
    try:
        cut, late, kept = two.decide([
            _req("a", "disk 97% on db-3", cancel=_CancelAfter(2)),
            _req("c", "disk 97% on db-3", deadline=time.monotonic() - 1.0),
            other,
        ])  # fmt: skip
        after = two.decide([other])[0]  # the group still works: no rank is left waiting
    finally:
        two.close()
    assert cut.stopped == "cancelled" and cut.traces["q"].second is None
    assert late.stopped == "deadline" and late.answers == {}
    assert kept.stopped is None
    assert kept.traces == alone.traces and after.traces == alone.traces
