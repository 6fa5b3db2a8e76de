"""Batcher rules checked as properties over random arrival streams."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_pipeline.core.batching import Batch, Batcher


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(1, 50),
    max_items=st.one_of(st.none(), st.integers(1, 6)),
    tokens=st.lists(st.integers(0, 80), max_size=60),
)
def test_batches_are_ordered_bounded_and_greedy(
    budget: int, max_items: int | None, tokens: list[int]
) -> None:
    b: Batcher[int] = Batcher(budget, max_wait_s=10.0, max_items=max_items)
    closed: list[Batch[int]] = []
    for i, n in enumerate(tokens):
        closed.extend(b.add(i, n, now=0.0))
    last = b.flush()
    batches = closed + ([last] if last else [])
    # Order is kept and nothing is lost or duplicated.
    assert [i for bt in batches for i in bt.items] == list(range(len(tokens)))
    for k, bt in enumerate(batches):
        assert bt.items
        assert bt.tokens == sum(tokens[i] for i in bt.items)
        assert bt.tokens <= budget or len(bt.items) == 1  # only a lone oversized item may exceed
        if max_items is not None:
            assert len(bt.items) <= max_items
        if k + 1 < len(batches):
            # Greedy: a batch closed early only because the next item did not fit or it was full.
            nxt = batches[k + 1].items[0]
            full = bt.tokens >= budget or (max_items is not None and len(bt.items) >= max_items)
            assert full or bt.tokens + tokens[nxt] > budget


def test_max_wait_closes_the_open_batch() -> None:
    b: Batcher[str] = Batcher(max_tokens=100, max_wait_s=0.05)
    assert b.deadline() is None and b.due(123.0) is None
    assert b.add("a", 10, now=1.0) == []
    assert b.add("b", 10, now=1.03) == []
    assert b.deadline() == pytest.approx(1.05)  # counted from the oldest item
    assert b.due(1.049) is None
    batch = b.due(1.05)
    assert batch is not None and batch.items == ["a", "b"] and batch.tokens == 20
    assert b.deadline() is None and b.pending_items == 0
    b.add("c", 5, now=2.0)
    assert b.deadline() == pytest.approx(2.05)


def test_oversized_item_goes_alone_and_budget_boundary_closes() -> None:
    b: Batcher[str] = Batcher(max_tokens=10, max_wait_s=1.0)
    assert b.add("a", 4, 0.0) == []
    out = b.add("huge", 25, 0.0)  # closes "a", then "huge" alone
    assert [x.items for x in out] == [["a"], ["huge"]]
    assert b.add("b", 6, 0.0) == []
    (exact,) = b.add("c", 4, 0.0)  # reaching the budget exactly closes the batch at once
    assert exact.items == ["b", "c"] and exact.tokens == 10


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        Batcher(0, 1.0)
    with pytest.raises(ValueError, match="max_wait_s"):
        Batcher(10, -1.0)
    with pytest.raises(ValueError, match="max_items"):
        Batcher(10, 1.0, max_items=0)
    with pytest.raises(ValueError, match="tokens"):
        Batcher(10, 1.0).add("x", -1, 0.0)
