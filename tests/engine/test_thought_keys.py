"""A decision depends on what is asked, not on its key (issue #20).

A thought's draws are keyed by what the model sees - the record seed, the evidence digest and the
question's think-prompt tokens - and the step. So a question renamed, asked twice in one request,
or asked by another event with the same evidence and seed thinks the same thought and reads the
same letters, bit for bit on the int8 path, whether its prefix was cached or not, and in the
per-question oracle mode.

Every question here thinks (gate 1) with a short budget, so the second read-out is always there.
Choice questions with more than 26 options never think, but their rounds (first read-out) are
checked for key independence too.
"""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.types import DecideRequest
from schemas.record import QuestionTrace
from schemas.systemone import SystemOneRequest

BUDGET = 6
MANY = {f"opt{i:02d}": (f"option number {i}" if i % 3 else None) for i in range(30)}
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for a refund?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this?",
        "criteria": {"billing": "Charges and invoices", "support": None, "engineering": "Bugs"},
    },
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["low", "medium", "high"]},
    "many": {"type": "choice", "instructions": "Which product?", "criteria": MANY},
}
STATE = {"ticket": 4411, "body": "I was charged twice for March, please refund one charge by Friday."}


@pytest.fixture(scope="module")
def engine(gguf_model) -> Engine:
    return Engine.load(gguf_model("Q8_0", "tiny", seed=5), precision="int8")


def ask(questions: dict, event: str = "evt", seed: int = 7, state: object = STATE) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": questions})
    return DecideRequest(event, body, seed=seed, gate=1.0, thought_budget=BUDGET)


def fingerprint(trace: QuestionTrace) -> tuple:
    """Everything a question's record carries about its reads and its thought, floats as hex."""

    def readout(ro) -> tuple | None:
        if ro is None:
            return None
        rounds = tuple(
            (tuple(r.options), tuple(x.hex() for x in r.logits), r.coverage.hex()) for r in ro.rounds
        )
        return tuple(p.hex() for p in ro.probabilities), ro.coverage.hex(), rounds

    return (
        trace.thought,
        trace.thought_tokens,
        trace.thought_truncated,
        trace.prompt_tokens,
        readout(trace.first),
        readout(trace.second),
        tuple(p.hex() for p in trace.final_probabilities),
    )


def decide_one(engine: Engine, request: DecideRequest) -> dict[str, tuple]:
    (result,) = engine.decide([request])
    assert result.error is None
    return {qid: fingerprint(t) for qid, t in result.traces.items()}


def test_a_question_thinks_the_same_under_two_keys_and_twice_in_one_request(engine: Engine) -> None:
    """The forest thought loop; tests/engine/decode/test_decoder_thought_keys.py does the decoder's."""
    base = decide_one(engine, ask(QUESTIONS))
    thinkers = {"refund", "team", "urgency"}  # gate 1: all but the >26 choice (rounds never think)
    assert {q for q, fp in base.items() if fp[5] is not None} == thinkers
    assert all(base[q][1] > 0 for q in thinkers), "every thinker should draw at least one token"
    renamed = {f"renamed_{qid}_x": q for qid, q in reversed(QUESTIONS.items())}
    again = decide_one(engine, ask(renamed))
    assert {qid: again[f"renamed_{qid}_x"] for qid in QUESTIONS} == base
    # every question twice in one request, under its own key and a copy's
    doubled = {**QUESTIONS, **{f"{qid}_copy": q for qid, q in QUESTIONS.items()}}
    both = decide_one(engine, ask(doubled))
    for qid in QUESTIONS:
        assert both[qid] == both[f"{qid}_copy"] == base[qid], qid


def test_the_event_id_does_not_take_part_but_the_seed_and_the_evidence_do(engine: Engine) -> None:
    """Two events with the same evidence, questions and seed get the same decisions: the event id
    reaches the draws only through the seed that the pipeline derives from it (and records)."""
    noul = {"q": QUESTIONS["refund"]}
    a = decide_one(engine, ask(noul, event="evt-a"))
    assert decide_one(engine, ask(noul, event="evt-b")) == a
    other_seed = [decide_one(engine, ask(noul, event="evt-a", seed=s))["q"][0] for s in range(8, 12)]
    assert any(t != a["q"][0] for t in other_seed), "the seed should move the thought"
    other_state = [decide_one(engine, ask(noul, state=f"{STATE['body']} #{i}"))["q"][0] for i in range(4)]
    assert any(t != a["q"][0] for t in other_state), "the evidence should move the thought"


def test_key_independence_holds_in_a_batch_from_the_cache_and_in_the_oracle_mode(engine: Engine) -> None:
    base = decide_one(engine, ask(QUESTIONS))
    renamed = {f"k{i}": q for i, q in enumerate(QUESTIONS.values())}
    companions = [ask({"z": QUESTIONS["team"]}, event=f"o{i}", state=f"alert {i}") for i in range(3)]
    results = engine.decide([companions[0], ask(renamed, event="other"), *companions[1:]])  # prefix cached
    got = {qid: fingerprint(t) for qid, t in results[1].traces.items()}
    assert {qid: got[f"k{i}"] for i, qid in enumerate(QUESTIONS)} == base
    (oracle,) = engine.decide([ask(renamed)], mode="per_question")
    assert {qid: fingerprint(oracle.traces[f"k{i}"]) for i, qid in enumerate(QUESTIONS)} == base
