"""Make long AutoThink thoughts visible: progress while they decode, a report when one never closes.

Why: with the default thought budget (4096 tokens) a model that never writes `</think>` decodes
for minutes per question on a CPU, and nothing said so (issue 22: one backfill question, 306 s,
silent). `ThoughtWatch` wraps the engine the worker, the demo and backfill use: while an engine
call is thinking it logs `engine.thinking` every `every_s` seconds (thought steps so far, how
long), and after the call it logs `engine.thought_unclosed` (a warning) for every question whose
thought hit the budget without closing, naming the event, the question and the budget. It changes
no decision: the hook only counts steps (the engine calls it between thought steps), and the
records are the engine's own.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import structlog

from engine.types import DecideRequest, DecideResult

log = structlog.get_logger(__name__)

PROGRESS_EVERY_S = 10.0


class ThoughtWatch:
    """A `DecisionEngine` that forwards to `engine` and watches its thoughts (module docstring)."""

    def __init__(
        self, engine: Any, every_s: float = PROGRESS_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.engine = engine
        self.every_s = every_s
        self.clock = clock
        self.unclosed = 0  # thoughts that hit the budget, over this watch's life
        try:
            params = inspect.signature(engine.decide).parameters
        except (TypeError, ValueError):
            params = {}
        self._hookable = "between_steps" in params and getattr(engine, "tp", None) is None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def decide(
        self,
        requests: list[DecideRequest],
        *,
        between_steps: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> list[DecideResult]:
        started = self.clock()
        state = {"steps": 0, "next": started + self.every_s}

        def step() -> None:
            state["steps"] += 1
            now = self.clock()
            if now >= state["next"]:
                state["next"] = now + self.every_s
                log.info(
                    "engine.thinking",
                    thought_steps=state["steps"],
                    seconds=round(now - started, 1),
                    requests=len(requests),
                )
            if between_steps is not None:
                between_steps()

        if self._hookable:
            results = self.engine.decide(requests, between_steps=step, **kwargs)
        elif between_steps is not None:
            results = self.engine.decide(requests, between_steps=between_steps, **kwargs)
        else:
            results = self.engine.decide(requests, **kwargs)
        self._report(requests, results)
        return results

    def _report(self, requests: list[DecideRequest], results: list[DecideResult]) -> None:
        budget = getattr(getattr(self.engine, "decision_config", None), "thought_budget", None)
        for req, res in zip(requests, results, strict=False):
            for qid, trace in res.traces.items():
                if trace.thought_truncated:
                    self.unclosed += 1
                    log.warning(
                        "engine.thought_unclosed",
                        event_id=req.request_id,
                        question=qid,
                        thought_tokens=trace.thought_tokens,
                        budget=budget,
                        hint="the model did not write </think> within the budget: a model that never "
                        "closes its thought decodes the whole budget per question; lower --thought-budget",
                    )
