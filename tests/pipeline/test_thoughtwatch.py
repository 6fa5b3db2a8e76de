"""`ThoughtWatch`: progress while an engine call thinks, and thoughts that never close reported."""

from __future__ import annotations

import structlog

from engine.types import DecideRequest
from prism_pipeline import synth
from prism_pipeline.core.thoughtwatch import ThoughtWatch
from prism_pipeline.evaluate import parse_items


def test_random_model_thoughts_hit_the_budget_and_are_reported(tiny_engine) -> None:
    # The tiny model's weights are random: it never draws </think>, so every thought runs to the
    # budget (3 tokens, the fixture's) - exactly the runaway the watch must report.
    import orjson

    item = parse_items([orjson.dumps(next(synth.generate(1, seed=3, split="watch")))])[0]
    ticks = iter(range(1000))
    watch = ThoughtWatch(tiny_engine, every_s=1.0, clock=lambda: float(next(ticks)))
    with structlog.testing.capture_logs() as logs:
        (result,) = watch.decide([DecideRequest(item.event_id, item.request, seed=1, gate=1.0)])
    truncated = [q for q, t in result.traces.items() if t.thought_truncated]
    assert truncated == list(item.request.questions)  # all of them, as decided by the engine itself
    unclosed = [e for e in logs if e["event"] == "engine.thought_unclosed"]
    assert sorted(e["question"] for e in unclosed) == sorted(truncated)
    assert all(e["log_level"] == "warning" and e["budget"] == 3 for e in unclosed)
    assert watch.unclosed == len(truncated)
    thinking = [e for e in logs if e["event"] == "engine.thinking"]
    assert thinking and thinking[-1]["thought_steps"] >= 3  # a fake clock second per step
    assert watch.model_digest == tiny_engine.model_digest  # everything else is the engine's


def test_a_callers_hook_still_runs_and_decisions_are_unchanged(tiny_engine) -> None:
    import orjson

    item = parse_items([orjson.dumps(next(synth.generate(1, seed=4, split="watch")))])[0]
    req = DecideRequest(item.event_id, item.request, seed=2, gate=1.0)
    calls = []
    watched = ThoughtWatch(tiny_engine).decide([req], between_steps=lambda: calls.append(1))
    plain = tiny_engine.decide([req])
    assert calls  # the caller's own between_steps ran once per thought step
    assert watched[0].answers == plain[0].answers
    assert watched[0].traces == plain[0].traces
