"""Engine-side ceilings and stops: operator caps on gate and budget, deadlines, cancellation.

The int8 engine on CPU, forest-step thought loop: a request cut mid-thought leaves the other
requests of its batch bit-for-bit as they are alone (the decoder loop's twin of that test is in
tests/engine/decode/test_decoder_stops.py, where the Triton interpreter is on).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.types import CancelToken, DecideRequest, DecideResult
from schemas.systemone import SystemOneRequest

CRITERIA = {"dba": None, "sre": None, "net": None}
QUESTION = {"type": "choice", "instructions": "Which team?", "criteria": CRITERIA}


@pytest.fixture(scope="module")
def int8_engine(module_tmp_path: Path, gguf_model: Callable[..., Path]) -> Engine:
    root = module_tmp_path  # the session's model, beside a config of its own
    path = Path(shutil.copyfile(gguf_model("Q8_0", "tiny"), root / "tiny-Q8_0.gguf"))
    (root / "decision_config.json").write_text(json.dumps({"thought_budget": 12}))
    return Engine.load(path, precision="int8")


class _CancelAfter(CancelToken):
    """Set after `polls` looks: a client that leaves mid-thought, at a reproducible step."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls

    def is_set(self) -> bool:
        self.polls -= 1
        return self.polls < 0


def _req(event_id: str, state: str, **kw: object) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": {"q": QUESTION}})
    return DecideRequest(event_id, body, seed=1, gate=1.0, **kw)  # type: ignore[arg-type]


def _bits(result: DecideResult) -> object:
    return {q: t.model_dump() for q, t in result.traces.items()}, result.answers


def test_ceilings_lower_the_gate_and_the_budget(int8_engine: Engine) -> None:
    plain, capped, no_think = int8_engine.decide([
        _req("a", "disk 97% on db-3", thought_budget=12),
        _req("a", "disk 97% on db-3", thought_budget=10_000, max_thought_budget=2),
        _req("a", "disk 97% on db-3", max_gate=0.0),
    ])  # fmt: skip
    assert plain.traces["q"].thought is not None
    assert capped.traces["q"].thought_tokens <= 2
    assert capped.traces["q"].thought_truncated or capped.traces["q"].thought_tokens < 2
    assert no_think.traces["q"].thought is None and no_think.traces["q"].second is None
    assert no_think.output_tokens == 0


def test_a_cancelled_thought_stops_and_leaves_its_companions_bits(int8_engine: Engine) -> None:
    other = _req("b", "api latency 900ms on checkout")
    alone = int8_engine.decide([other])[0]
    cut, together = int8_engine.decide([_req("a", "disk 97% on db-3", cancel=_CancelAfter(3)), other])
    assert alone.traces["q"].thought_tokens > 3  # the companion thinks past the cut step
    assert cut.stopped == "cancelled" and together.stopped is None
    assert cut.traces["q"].second is None and cut.traces["q"].thought_tokens <= 3
    assert _bits(together) == _bits(alone)


def test_a_request_past_its_deadline_runs_nothing(int8_engine: Engine) -> None:
    late, on_time = int8_engine.decide([
        _req("a", "disk 97% on db-3", deadline=time.monotonic() - 1.0),
        _req("b", "disk 97% on db-3", deadline=time.monotonic() + 600.0),
    ])  # fmt: skip
    assert late.stopped == "deadline" and late.answers == {}
    assert on_time.stopped is None and on_time.answers


def test_a_cancel_token_pickles_unset() -> None:
    """Tensor-parallel followers receive requests pickled: the token must travel, and not fire there."""
    import pickle

    token = CancelToken()
    token.cancel()
    assert token.is_set() and not pickle.loads(pickle.dumps(token)).is_set()


def test_a_request_that_does_not_think_is_handed_over_before_the_thoughts(int8_engine: Engine) -> None:
    """`on_ready` gives a non-thinking request's final result before its companions' thoughts run;
    the result is the one returned, with the bits of a call without `on_ready`."""
    polls = _CancelAfter(10_000)  # never fires; counts the thinker's thought steps
    thinker = _req("a", "disk 97% on db-3", cancel=polls)
    short = DecideRequest("b", SystemOneRequest.model_validate({"state": "ok", "questions": {"q": QUESTION}}))
    handed: list[tuple[int, DecideResult, int]] = []
    results = int8_engine.decide([thinker, short], on_ready=lambda i, r: handed.append((i, r, polls.polls)))
    # one look when the call starts, none yet from a thought step
    assert [(i, steps) for i, _, steps in handed] == [(1, 9_999)]
    assert handed[0][1] is results[1]
    assert polls.polls < 10_000  # the thinker did think afterwards
    plain = int8_engine.decide([_req("a", "disk 97% on db-3"), short])
    assert _bits(plain[1]) == _bits(results[1]) and _bits(plain[0]) == _bits(results[0])


def test_work_run_between_thought_steps_changes_no_bits(int8_engine: Engine) -> None:
    """A nested `decide` between every two thought steps (what the dispatcher's side lane does):
    the thinker's thought and answers, and the nested request's, equal those computed alone."""
    thinker = _req("a", "disk 97% on db-3")
    short = DecideRequest(
        "b", SystemOneRequest.model_validate({"state": "ok", "questions": {"q": QUESTION}}), gate=0.0
    )
    alone_thinker = int8_engine.decide([thinker])[0]
    alone_short = int8_engine.decide([short])[0]
    nested: list[DecideResult] = []
    handed: list[int] = []  # the outer call's on_ready: a nested result must never reach it
    mixed = int8_engine.decide(
        [thinker],
        on_ready=lambda i, r: handed.append(i),
        between_steps=lambda: nested.extend(int8_engine.decide([short])),
    )
    assert handed == []  # the thinker is final only at the end; nested results stayed nested
    assert len(nested) > 3 and alone_thinker.traces["q"].thought_tokens > 3
    assert _bits(mixed[0]) == _bits(alone_thinker)
    assert all(_bits(n) == _bits(alone_short) for n in nested)


def test_work_between_thought_steps_may_not_think(int8_engine: Engine) -> None:
    """Its thought would share the outer call's decoder and buffers: refused, not corrupted."""
    thinker = _req("a", "disk 97% on db-3", thought_budget=2)
    errors: list[str] = []

    def nested() -> None:
        try:
            int8_engine.decide([_req("b", "ok")])
        except RuntimeError as e:
            errors.append(str(e))

    int8_engine.decide([thinker], between_steps=nested)
    assert errors and "must not think" in errors[0]
