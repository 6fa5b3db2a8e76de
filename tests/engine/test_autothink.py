"""AutoThink: the gate, seeded thoughts independent of the batch, the budget, the second read-out."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.decide.sampling import sample_token, thought_key, uniform
from engine.engine import Engine
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

PRECISION = "int8"
QUESTION = {
    "type": "choice",
    "instructions": "Which team?",
    "criteria": {"dba": None, "sre": None, "net": None},
}


@pytest.fixture(scope="module")
def engine(gguf_model) -> Engine:
    return Engine.load(gguf_model("Q8_0", "tiny", seed=11), precision=PRECISION, cache_bytes=0)


def req(event_id: str, state: str, gate: float | None, budget: int = 12, seed: int = 3) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": {"q": QUESTION}})
    return DecideRequest(event_id, body, seed=seed, gate=gate, thought_budget=budget)


def bits(values: list[float]) -> list[str]:
    return [v.hex() for v in values]


def test_thought_is_independent_of_the_batch(engine: Engine) -> None:
    target = req("target", "api latency 900ms on checkout, db-3 cpu 95%", gate=1.0)
    alone = engine.decide([target])[0].traces["q"]
    assert alone.thought_tokens > 0 and alone.second is not None
    others = [req(f"other-{i}", f"alert {i}: pod restarts x{i * 7}", gate=1.0, seed=i) for i in range(15)]
    rng = random.Random(0)
    for _ in range(3):
        batch = [target, *others]
        rng.shuffle(batch)
        results = {r.request_id: r for r in engine.decide(batch)}
        together = results["target"].traces["q"]
        assert together.thought == alone.thought
        assert together.thought_tokens == alone.thought_tokens
        assert bits(together.final_probabilities) == bits(alone.final_probabilities)
        assert bits(together.second.rounds[0].logits) == bits(alone.second.rounds[0].logits)


def test_questions_at_or_above_the_gate_never_think(engine: Engine) -> None:
    first = engine.decide([req("e", "disk 97% on db-3", gate=0.0)])[0].traces["q"]
    assert first.second is None and first.thought is None
    top = max(first.first.probabilities)
    # inclusive boundary: top == gate stands; just above top thinks
    at_gate = engine.decide([req("e", "disk 97% on db-3", gate=top)])[0].traces["q"]
    assert at_gate.thought is None and at_gate.thought_tokens == 0
    above = engine.decide([req("e", "disk 97% on db-3", gate=math.nextafter(top, 1.0))])[0].traces["q"]
    assert above.thought is not None and above.second is not None
    # the first read-out is the same whether or not the question then thinks
    assert bits(above.first.probabilities) == bits(first.first.probabilities)


def test_budget_is_enforced(engine: Engine) -> None:
    for budget in (1, 3, 8):
        trace = engine.decide([req("b", "cert expires in 2 days", gate=1.0, budget=budget)])[0].traces["q"]
        assert trace.thought_tokens <= budget
        if trace.thought_truncated:
            assert trace.thought_tokens == budget
        assert trace.second is not None
        assert abs(sum(trace.second.probabilities) - 1.0) <= 1e-6


def test_default_mixing_uses_the_second_read_out(engine: Engine) -> None:
    trace = engine.decide([req("m", "5xx spike after deploy", gate=1.0)])[0].traces["q"]
    assert trace.final_probabilities == trace.second.probabilities


def test_seed_changes_the_thought(engine: Engine) -> None:
    a = engine.decide([req("s", "queue backlog 1M messages", gate=1.0, budget=16, seed=1)])[0]
    b = engine.decide([req("s", "queue backlog 1M messages", gate=1.0, budget=16, seed=2)])[0]
    assert a.traces["q"].thought != b.traces["q"].thought


# --- the sampler on its own -------------------------------------------------------------------


def test_uniform_is_a_pure_function_of_the_counter() -> None:
    key = thought_key(1, "e" * 64, [5, 6, 7])
    assert uniform(key, 0) == uniform(thought_key(1, "e" * 64, [5, 6, 7]), 0)
    draws = {uniform(key, step) for step in range(1000)}
    assert len(draws) == 1000 and all(0.0 <= u < 1.0 for u in draws)
    # every part of what the model sees, and the seed, moves the draws
    others = [thought_key(2, "e" * 64, [5, 6, 7]), thought_key(1, "f" * 64, [5, 6, 7])]
    others += [thought_key(1, "e" * 64, [5, 6]), thought_key(1, "e" * 64, [5, 7, 6])]
    assert len({uniform(k, 0) for k in [key, *others]}) == 5


def test_sampler_filters_and_inverse_cdf() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0, -5.0])
    # greedy: the first of the equal maxima
    assert sample_token(logits, 0.5, temperature=0.0, top_p=1.0, top_k=0) == 1
    # top-k 2 keeps the two 2.0 logits (ids 1 and 3), each with probability 1/2
    assert sample_token(logits, 0.25, temperature=1.0, top_p=1.0, top_k=2) == 1
    assert sample_token(logits, 0.75, temperature=1.0, top_p=1.0, top_k=2) == 3
    # frequencies follow the softmax when nothing is filtered
    counts = torch.zeros(5)
    for i in range(4000):
        counts[sample_token(logits, (i + 0.5) / 4000, temperature=1.0, top_p=1.0, top_k=0)] += 1
    expected = torch.softmax(logits.double(), 0) * 4000
    assert torch.allclose(counts.double(), expected, atol=2.0)
    # top-p 0.5: the smallest prefix of the sorted distribution reaching 0.5 is the first token
    assert {sample_token(logits, u / 10, temperature=1.0, top_p=0.3, top_k=0) for u in range(10)} == {1}
