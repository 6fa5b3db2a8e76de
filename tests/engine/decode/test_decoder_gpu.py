"""The decoder on CUDA: graph replay equals eager bitwise; thoughts through Engine.decide are
bit-identical alone and beside 15 other thinkers."""

from __future__ import annotations

import random

import pytest
import torch
from decode_engines import same_weights

from engine.engine import Engine
from engine.run.decoder import Decoder
from engine.run.executor import run_forest
from engine.run.forest import Segment, build_forest
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest
from tests.engine.decode.test_decoder_engine import QUESTION

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _req(event_id: str, state: str, budget: int = 12, seed: int = 3) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": {"q": QUESTION}})
    return DecideRequest(event_id, body, seed=seed, gate=1.0, thought_budget=budget)


def _bits(values: list[float]) -> list[str]:
    return [v.hex() for v in values]


DOTS = ["ieee", "bf16"]  # the exact decoder's, and the CUDA default body's attention dots


@pytest.fixture(params=DOTS)
def dots_engine(request: pytest.FixtureRequest, engine: Engine) -> Engine:
    """The engine's weights with its thought decoder on the given attention dots."""
    return same_weights(engine, decoder=True, decoder_dots=request.param)


@pytest.mark.parametrize("dots", DOTS)
def test_graph_replay_equals_eager(engine: Engine, dots: str) -> None:
    g = torch.Generator().manual_seed(2)
    segs = [Segment(tuple(torch.randint(100, 5000, (40,), generator=g).tolist()), engine.root)]
    segs += [
        Segment(tuple(torch.randint(100, 5000, (5 + i,), generator=g).tolist()), 0, read=True)
        for i in range(16)
    ]
    forest = build_forest(segs)
    out = run_forest(engine.weights, forest)
    prompts = [out.states[forest.packed_index[i]] for i in range(1, 17)]
    graphed = Decoder(engine.weights, graphs=True, attention_dots=dots)
    eager = Decoder(engine.weights, graphs=False, attention_dots=dots)
    a = [graphed.start(p, capacity=200) for p in prompts]
    b = [eager.start(p, capacity=200) for p in prompts]
    rng = random.Random(0)
    for step in range(80):  # past the first buffer growth (64 rows)
        n = [16, 5, 1, 9, 2][step % 5]
        rows = rng.sample(range(16), n)
        toks = [rng.randrange(100, 5000) for _ in rows]
        la = graphed.step([a[r] for r in rows], toks)
        lb = eager.step([b[r] for r in rows], toks)
        assert torch.equal(la, lb), step
    assert all(bucket.graph is not None for bucket in graphed._bucket_cache.values())


def test_thought_alone_equals_thought_beside_15_others(dots_engine: Engine) -> None:
    engine = dots_engine
    target = _req("target", "api latency 900ms on checkout, db-3 cpu 95%", budget=40)
    alone = engine.decide([target])[0].traces["q"]
    assert engine.runner.decoder.steps > 0
    assert alone.thought_tokens > 0 and alone.second is not None
    others = [
        _req(f"other-{i}", f"alert {i}: pod restarts x{i * 7}", budget=8 + 5 * i, seed=i) for i in range(15)
    ]
    rng = random.Random(0)
    for _ in range(3):
        batch = [target, *others]
        rng.shuffle(batch)
        together = {r.request_id: r for r in engine.decide(batch)}["target"].traces["q"]
        assert together.thought == alone.thought and together.thought_tokens == alone.thought_tokens
        assert _bits(together.final_probabilities) == _bits(alone.final_probabilities)
        assert _bits(together.second.rounds[0].logits) == _bits(alone.second.rounds[0].logits)


def test_decide_decodes_to_the_budget_and_reads_again(engine: Engine) -> None:
    for budget in (1, 64, 300):
        trace = engine.decide([_req("b", "cert expires in 2 days", budget=budget)])[0].traces["q"]
        assert 0 <= trace.thought_tokens <= budget
        assert trace.thought_truncated == (trace.thought_tokens == budget)
        assert trace.second is not None and abs(sum(trace.second.probabilities) - 1.0) <= 1e-6


@pytest.mark.parametrize("ahead", [False, True])
def test_thoughts_drawn_in_the_step_equal_the_host_draws(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, ahead: bool
) -> None:
    """With the draw in the step's graph (`decoder.DRAW_IN_STEP`: `row_top_k` and the float64 draw
    kernel compiled, the uniforms loaded with the row table), and with each step queued before the
    previous one is read, fed its own draws on the device (`thoughts.RUN_AHEAD`), 16 thinkers get
    the traces the host sampler gives them, bit for bit, together in any order and the target
    alone; the host drew only each thought's first token."""
    import engine.decide.sampling as sampling
    import engine.run.decoder as decoder_module
    import engine.thoughts as thoughts

    target = _req("target", "api latency 900ms on checkout, db-3 cpu 95%", budget=40)
    others = [
        _req(f"other-{i}", f"alert {i}: pod restarts x{i * 7}", budget=8 + 5 * i, seed=i) for i in range(15)
    ]
    batch = [target, *others]
    monkeypatch.setattr(decoder_module, "DRAW_IN_STEP", False)  # the host's draws
    monkeypatch.setattr(thoughts, "RUN_AHEAD", False)
    want = {
        r.request_id: r.traces for r in same_weights(engine, decoder=True, decoder_dots="bf16").decide(batch)
    }
    assert sum(t.thought_tokens for traces in want.values() for t in traces.values()) > 16 * 4
    monkeypatch.setattr(decoder_module, "DRAW_IN_STEP", True)  # the default since session 32
    monkeypatch.setattr(thoughts, "RUN_AHEAD", ahead)
    host_rows: list[int] = []
    real = sampling._top_k_tokens
    monkeypatch.setattr(
        sampling, "_top_k_tokens", lambda rows, *a, **kw: host_rows.append(len(rows)) or real(rows, *a, **kw)
    )
    drawing = same_weights(engine, decoder=True, decoder_dots="bf16")
    assert drawing.decide([target])[0].traces == want["target"]
    assert sum(host_rows) == 1
    rng = random.Random(4)
    for _ in range(2):
        rng.shuffle(batch)
        host_rows.clear()
        got = {r.request_id: r.traces for r in drawing.decide(batch)}
        assert got == want
        assert sum(host_rows) == 16
    assert all(
        b.draw is not None and b.graph is not None for b in drawing.runner.decoder._bucket_cache.values()
    )
