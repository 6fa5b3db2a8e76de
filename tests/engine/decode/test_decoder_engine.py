"""`engine.thoughts.think` through the decoder (forced on CPU) against the forest-step thought loop."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

QUESTION = {
    "type": "choice",
    "instructions": "Which team?",
    "criteria": {"dba": None, "sre": None, "net": None},
}


def _req(event_id: str, state: str, budget: int, seed: int = 3) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": {"q": QUESTION, "r": QUESTION}})
    return DecideRequest(event_id, body, seed=seed, gate=1.0, thought_budget=budget)


def test_decoder_thoughts_equal_the_forest_thoughts(
    decoder_engine: Engine, forest_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same draws, budget cut, `</think>` closing and second read-out as the forest loop.

    Both loops see the same logits up to fp32 rounding (the decoder's kernels reduce in their
    own order), far below any gap the draws could fall into here, so the sampled thoughts are
    the same tokens; the read-outs agree to rounding.
    """
    requests = [
        _req("a", "api latency 900ms on checkout, db-3 cpu 95%", budget=1),
        _req("b", "disk 97% on db-3", budget=5, seed=9),
    ]
    forest = forest_engine.decide(requests)
    decoded = decoder_engine.decide(requests)
    decoder = decoder_engine.runner.decoder
    # one live thought at a time (as when memory is short): the same bits
    with monkeypatch.context() as patch:
        patch.setattr(decoder, "max_live", lambda capacity: 1)
        one_by_one = decoder_engine.decide(requests)
    assert decoder.steps > 0
    assert all(not b.held and b.members is None for b in decoder._bucket_cache.values())
    for d, o in zip(decoded, one_by_one, strict=True):
        assert d.traces == o.traces
    thought_tokens = []
    for f, d in zip(forest, decoded, strict=True):
        for qid in ("q", "r"):
            ft, dt = f.traces[qid], d.traces[qid]
            assert dt.first == ft.first  # the first read-out does not involve the decoder
            assert dt.thought == ft.thought
            assert dt.thought_tokens == ft.thought_tokens and dt.thought_truncated == ft.thought_truncated
            assert dt.second is not None and ft.second is not None
            for p, q in zip(dt.second.probabilities, ft.second.probabilities, strict=True):
                assert abs(p - q) <= 1e-4
            thought_tokens.append(dt.thought_tokens)
    assert thought_tokens[:2] == [1, 1]  # budget 1: cut, then closed
    assert all(0 < t <= 5 for t in thought_tokens[2:])


def test_thoughts_from_the_steps_own_sampler_numbers_or_draws_are_the_same_thoughts(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the sampler's top-k numbers made in each decoder step (`decoder.TOP_K_IN_STEP`), with
    each thought's next token drawn there (`decoder.DRAW_IN_STEP`, the uniforms handed over by the
    thought loop), and with each step queued before the previous one is read, fed its own draws
    (`thoughts.RUN_AHEAD`) - all set up by `DecoderSteps` from the decision config - the thoughts,
    their cuts and both read-outs are the ones the host sampler makes when it does everything
    after each step. The host computed the top-k numbers, and with the step's draws drew tokens,
    only for each thought's first draw, whose logits come from the forest read-out."""
    from decode_engines import same_weights

    import engine.decide.sampling as sampling
    import engine.run.decoder as decoder_module
    import engine.thoughts as thoughts

    requests = [
        _req("a", "api latency 900ms on checkout, db-3 cpu 95%", budget=1),
        _req("b", "disk 97% on db-3", budget=5, seed=9),
    ]
    switches = [(decoder_module, "TOP_K_IN_STEP"), (decoder_module, "DRAW_IN_STEP"), (thoughts, "RUN_AHEAD")]
    for module, name in switches:  # the host loop: every switch off
        monkeypatch.setattr(module, name, False)
    plain = same_weights(engine, decoder=True).decide(requests)
    assert sum(t.thought_tokens for r in plain for t in r.traces.values()) > 4  # the steps draw too
    top_k_rows: list[int] = []
    host_rows: list[int] = []
    fed_on: list[int] = []
    real_top_k, real_host = sampling.packed_top_k, sampling._top_k_tokens
    real_step = thoughts.DecoderSteps.step
    monkeypatch.setattr(
        sampling, "packed_top_k", lambda x, k: top_k_rows.append(x.shape[0]) or real_top_k(x, k)
    )
    monkeypatch.setattr(
        sampling,
        "_top_k_tokens",
        lambda rows, *a, **kw: host_rows.append(len(rows)) or real_host(rows, *a, **kw),
    )
    monkeypatch.setattr(
        thoughts.DecoderSteps,
        "step",
        lambda self, handles, feeds, us: (
            fed_on.append(feeds.count(None)) or real_step(self, handles, feeds, us)
        ),
    )
    for on in [switches[:1], switches[1:2], switches[1:]]:
        top_k_rows.clear()
        host_rows.clear()
        fed_on.clear()
        with monkeypatch.context() as patch:
            for module, name in on:
                patch.setattr(module, name, True)
            stepped = same_weights(engine, decoder=True)
            got = stepped.decide(requests)
        assert [r.traces for r in got] == [r.traces for r in plain], on
        buckets = stepped.runner.decoder._bucket_cache.values()
        made = [b.top_k if on[0][1] == "TOP_K_IN_STEP" else b.draw for b in buckets]
        assert made and all(m is not None for m in made), on
        assert sum(top_k_rows) == 4, on  # two questions a request, each thought's first draw
        if on[0][1] == "DRAW_IN_STEP":
            assert sum(host_rows) == 4, on
        assert (sum(fed_on) > 0) == (len(on) == 2), on  # ahead: thoughts fed their steps' own draws
