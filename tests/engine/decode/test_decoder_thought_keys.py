"""Thoughts decoded by `engine.run.decoder` (forced on CPU: the Triton interpreter) are keyed by what
the model sees, not by the question's key: a question renamed, or asked twice in one request,
gets the same thought and the same read-outs, bit for bit (int8). The forest loop's counterpart is
tests/engine/test_thought_keys.py."""

from __future__ import annotations

from engine.engine import Engine
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

QUESTION = {
    "type": "choice",
    "instructions": "Which team?",
    "criteria": {"dba": None, "sre": None, "net": None},
}
NOUL = {"type": "noul", "instructions": "Is a database involved?"}


def _decide(engine: Engine, questions: dict) -> dict:
    body = SystemOneRequest.model_validate({"state": "disk 97% on db-3", "questions": questions})
    (result,) = engine.decide([DecideRequest("evt", body, seed=4, gate=1.0, thought_budget=4)])
    return result.traces


def test_decoder_thoughts_do_not_depend_on_question_keys(decoder_engine: Engine) -> None:
    engine = decoder_engine
    base = _decide(engine, {"team": QUESTION, "db": NOUL})
    doubled = _decide(engine, {"db_again": NOUL, "db": NOUL, "who": QUESTION, "team": QUESTION})
    assert engine.runner.decoder.steps > 0
    assert base["team"].thought_tokens > 0 and base["team"].second is not None
    # QuestionTrace is a pydantic model: == compares every float exactly
    assert doubled["team"] == doubled["who"] == base["team"]
    assert doubled["db"] == doubled["db_again"] == base["db"]
