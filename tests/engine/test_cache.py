"""Cross-request prefix cache: exact-match hits, identical results, LRU within a byte budget."""

from __future__ import annotations

import pytest
import torch

from engine.cache import PrefixCache, prefix_key
from engine.engine import Engine
from engine.run.forest import SegmentState
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is this urgent?"},
    "team": {
        "type": "choice",
        "instructions": "Which team owns it?",
        "criteria": {"dba": "databases", "sre": None},
    },
    "sev": {"type": "score", "instructions": "Severity?", "criteria": ["low", "medium", "high"]},
}


def request(state: object, questions: dict | None = None) -> SystemOneRequest:
    return SystemOneRequest.model_validate({"state": state, "questions": questions or QUESTIONS})


def probabilities(result) -> dict[str, list[float]]:
    return {qid: t.final_probabilities for qid, t in result.traces.items()}


@pytest.fixture(scope="module")
def engine(gguf_model) -> Engine:
    return Engine.load(gguf_model("Q8_0", "tiny", seed=5), cache_bytes=1 << 30)


def evidence(n_words: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    words = ["disk", "latency", "pod", "oom", "restart", "5xx", "db-3", "us-east", "cert", "deploy"]
    return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n_words,), generator=g))


def test_follow_up_hits_and_matches_a_miss(engine: Engine) -> None:
    engine.cache.clear()
    state = evidence(300, 1)
    first = engine.decide([DecideRequest("a", request(state), gate=0.0)])[0]
    assert engine.cache.stats.entries >= 1
    hits_before = engine.cache.stats.hits
    follow = {"why": {"type": "noul", "instructions": "Is the database involved?"}}
    again = engine.decide([DecideRequest("b", request(state, {**QUESTIONS, **follow}), gate=0.0)])[0]
    assert engine.cache.stats.hits == hits_before + 1
    # only the question segments ran: no evidence level in the forest
    assert len(engine.last_counters[0].tokens_per_level) == 1
    engine.cache.clear()
    cold = engine.decide([DecideRequest("c", request(state, {**QUESTIONS, **follow}), gate=0.0)])[0]
    assert len(engine.last_counters[0].tokens_per_level) == 2
    for qid in QUESTIONS:
        a, b = first.traces[qid].final_probabilities, again.traces[qid].final_probabilities
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-6
    for qid in cold.traces:
        a, b = cold.traces[qid].final_probabilities, again.traces[qid].final_probabilities
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-6


def test_one_token_change_misses(engine: Engine) -> None:
    engine.cache.clear()
    state = evidence(120, 2)
    engine.decide([DecideRequest("a", request(state), gate=0.0)])
    misses = engine.cache.stats.misses
    changed = state.replace("disk", "disc", 1) if "disk" in state else state + " x"
    engine.decide([DecideRequest("b", request(changed), gate=0.0)])
    assert engine.cache.stats.misses == misses + 1
    assert len(engine.last_counters[0].tokens_per_level) == 2  # evidence recomputed


def test_mixed_hits_and_misses_equal_all_misses(engine: Engine) -> None:
    states = [evidence(50 + 40 * i, 10 + i) for i in range(5)]
    engine.cache.clear()
    engine.decide([DecideRequest(f"w{i}", request(states[i]), gate=0.0) for i in (0, 2, 4)])
    mixed = engine.decide([DecideRequest(f"m{i}", request(s), gate=0.0) for i, s in enumerate(states)])
    engine.cache.clear()
    cold = engine.decide([DecideRequest(f"m{i}", request(s), gate=0.0) for i, s in enumerate(states)])
    for m, c in zip(mixed, cold, strict=True):
        for qid in QUESTIONS:
            pm, pc = m.traces[qid].final_probabilities, c.traces[qid].final_probabilities
            assert max(abs(x - y) for x, y in zip(pm, pc, strict=True)) <= 1e-6


def test_key_covers_tokens_and_images() -> None:
    base = prefix_key([1, 2, 3])
    assert prefix_key([1, 2, 3]) == base
    assert prefix_key([1, 2, 4]) != base
    assert prefix_key([1, 2]) != base
    assert prefix_key([1, 2, 3], ["a" * 64]) != base
    assert prefix_key([1, 2, 3], ["a" * 64]) != prefix_key([1, 2, 3], ["b" * 64])


def fake_state(nbytes: int) -> SegmentState:
    st = SegmentState(parent=None, start=0, length=1)
    st.conv[0] = torch.zeros(nbytes // 4, dtype=torch.float32)
    return st


def test_lru_within_budget_under_churn() -> None:
    cache = PrefixCache(budget_bytes=10_000)
    g = torch.Generator().manual_seed(0)
    order: list[str] = []  # our own LRU model: least recent first
    for step in range(400):
        key = f"k{int(torch.randint(0, 40, (1,), generator=g))}"
        if cache.get(key) is not None:
            order.remove(key)
            order.append(key)
        else:
            size = 4 * int(torch.randint(100, 900, (1,), generator=g))
            sizes = {k: cache._entries[k][1] for k in cache.lru_keys()}
            stored = cache.put(key, fake_state(size))
            assert stored
            # the model: evict from the least recent until it fits
            while sum(sizes.values()) + size > cache.budget:
                victim = order.pop(0)
                sizes.pop(victim)
            order.append(key)
        assert cache.stats.bytes <= cache.budget
        assert cache.lru_keys() == order, f"step {step}"


def test_pinned_entries_are_never_evicted() -> None:
    cache = PrefixCache(budget_bytes=4000)
    cache.put("old", fake_state(2000))
    cache.pin("old")
    assert cache.put("new", fake_state(2000))
    assert not cache.put("big", fake_state(2400))  # would need to evict the pinned entry
    assert "old" in cache
    assert cache.stats.bytes <= cache.budget
    cache.unpin("old")
    assert cache.put("big", fake_state(2400))
    assert "old" not in cache
    assert cache.stats.bytes <= cache.budget


def test_entry_larger_than_budget_is_not_stored() -> None:
    cache = PrefixCache(budget_bytes=100)
    assert not cache.put("x", fake_state(400))
    assert len(cache) == 0 and cache.stats.rejected == 1
