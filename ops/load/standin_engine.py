"""A benchmark harness: `prism run` with an engine stand-in of a fixed, declared cost per event.

    python -m ops.load.standin_engine --log-json run --standin-cost-us 0 <prism run flags>
    python -m ops.load.standin_engine --standin-profile /tmp/w.prof --log-json run ... (cProfile)

Why it exists: the pipeline's own cost (consume, validate, batch, build and publish records,
commit) is invisible behind a real model, which takes 0.1-0.5 s an event on CPU. With an engine
whose cost is a number the operator declares, what a benchmark measures beyond that number is the
pipeline's. This is never a worker default: it is its own entry point, its records name it
(`model.name` "prism-standin-engine", a digest of the declared cost), and `prism run` cannot load it.

The worker is the real one (`prism_pipeline.worker.runner.run_worker`, same settings, same
validate -> batch -> decide -> publish path); only the engine differs. The stand-in answers every
question with a well-formed read-out: probabilities drawn from a hash of the evidence, the
question id and the question (not the seed), so the same event always gets the same record (a
redelivered event is a byte-identical duplicate, as under the real int8 engine). Answers are kept
per (evidence, question): the load events repeat the bundled samples under fresh ids, so after
the first of each the stand-in's own work is a hash and a lookup (~15 us an event, measured).
The read-outs are built without pydantic's validation (`model_construct`; validated, and without
the cache, they cost ~350 us an event, more than the costs this harness declares); their shape is
the contract's, which the harness's test checks by parsing every published record with
`DecisionRecord.model_validate_json`.

Cost model: one `decide` call of n requests takes `cost_us * n` microseconds of wall time (the
answers are built first and the rest of the budget is slept, releasing the GIL as an accelerator
would). Token counts are a declared estimate (4 characters a token), not a tokenizer's.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from engine.decide.answers import answer_for
from engine.decide.decision_config import DecisionConfig
from engine.types import DecideRequest, DecideResult
from ops.load.worker_main import run_with_engine
from prism_pipeline.worker.settings import WorkerSettings
from schemas.record import QuestionTrace, Readout, RoundReadout
from schemas.systemone import Question, SystemOneRequest

STANDIN_NAME = "prism-standin-engine"
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_CACHE_ENTRIES = 8192  # answers kept per (evidence, question); cleared whole when full


def option_ids(question: Question) -> list[str]:
    """The option ids the real engine reads out for a question (`engine.engine._Question`)."""
    if question.type == "noul":
        return ["yes", "no"]
    criteria = question.criteria
    if question.type == "score":
        return [str(i) for i in range(len(criteria))]  # type: ignore[arg-type]
    return list(criteria)  # type: ignore[arg-type]


def _probabilities(digest: bytes, n: int) -> list[float]:
    weights = [1 + digest[i % len(digest)] for i in range(n)]
    total = float(sum(weights))
    return [w / total for w in weights]


class StandinEngine:
    """The `DecisionEngine` protocol at a declared cost of `cost_us` microseconds per event."""

    precision = "int8"  # a label the record contract needs; no arithmetic happens at any precision
    engine_version = "standin-1"
    render_version = "standin-1"

    def __init__(self, cost_us: float) -> None:
        if cost_us < 0:
            raise ValueError(f"the stand-in's cost must be >= 0 us, got {cost_us}")
        self.cost_us = cost_us
        self.model_name = STANDIN_NAME
        self.model_digest = hashlib.sha256(f"{STANDIN_NAME} cost_us={cost_us:g}".encode()).hexdigest()
        self.decision_config = DecisionConfig(gate=0.0, thought_budget=1)  # gate 0: it never thinks
        self.calls = 0
        self._answers: dict[bytes, tuple[Any, QuestionTrace]] = {}

    def count_tokens(self, request: SystemOneRequest) -> int:
        """A declared estimate (4 characters a token), not a tokenizer."""
        state = request.state if isinstance(request.state, str) else orjson.dumps(request.state)
        return 1 + len(state) // 4 + 16 * len(request.questions)

    def decide(self, requests: list[DecideRequest]) -> list[DecideResult]:
        t0 = time.monotonic()
        self.calls += 1
        out = [self._one(r) for r in requests]
        left = t0 + self.cost_us * 1e-6 * len(requests) - time.monotonic()
        if left > 0:
            time.sleep(left)
        return out

    def _one(self, req: DecideRequest) -> DecideResult:
        state = req.request.state
        body = state.encode() if isinstance(state, str) else orjson.dumps(state)
        answers: dict[str, Any] = {}
        traces: dict[str, QuestionTrace] = {}
        tokens = 0
        for qid, q in req.request.questions.items():
            key = hashlib.blake2b(body + b"\0" + qid.encode() + b"\0" + q.model_dump_json().encode()).digest()
            got = self._answers.get(key)
            if got is None:
                got = self._answer(q, key, len(body))
                if len(self._answers) >= _CACHE_ENTRIES:
                    self._answers.clear()
                self._answers[key] = got
            answers[qid], traces[qid] = got
            tokens += got[1].prompt_tokens
        return DecideResult(
            request_id=req.request_id, answers=answers, traces=traces, input_tokens=tokens, output_tokens=0
        )

    def _answer(self, q: Question, key: bytes, body_chars: int) -> tuple[Any, QuestionTrace]:
        opts = option_ids(q)
        probs = _probabilities(key, len(opts))
        rounds = [
            RoundReadout.model_construct(
                options=opts[i : i + 26],
                letters=list(_LETTERS[: len(opts[i : i + 26])]),
                logits=[round(p * 10, 6) for p in probs[i : i + 26]],
                coverage=0.0,
            )
            for i in range(0, len(opts), 26)
        ]
        first = Readout.model_construct(
            options=opts, probabilities=probs, coverage=0.0, temperature=1.0, rounds=rounds
        )
        trace = QuestionTrace.model_construct(
            prompt_tokens=16 + body_chars // 4,
            first=first,
            second=None,
            thought=None,
            thought_tokens=0,
            thought_truncated=False,
            final_probabilities=probs,
        )
        return answer_for(q, probs, confidence=self.decision_config.confidence), trace


class ThreadProfiles:
    """cProfile of every thread (Python 3.11's cProfile sees only the thread that enables it): the
    main thread's profiler, and one per thread started after `start`, merged by `dump`; each
    counts its own thread's CPU time."""

    def __init__(self) -> None:
        self._profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()

    def _new(self) -> cProfile.Profile:
        # CPU time of the thread, not wall time: under the GIL and on shared cores a wall clock
        # would charge a function for the time its thread waited to run.
        prof = cProfile.Profile(time.thread_time)
        with self._lock:
            self._profiles.append(prof)
        return prof

    def start(self) -> None:
        def first_call(*_: Any) -> None:  # runs once in each new thread: lsprof replaces it there
            self._new().enable()

        threading.setprofile(first_call)  # type: ignore[arg-type]
        self._new().enable()

    def dump(self, path: Path) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]
        with self._lock:
            profiles = list(self._profiles)
        for p in profiles:
            p.disable()
        stats = pstats.Stats(profiles[0])
        for p in profiles[1:]:
            stats.add(p)
        stats.dump_stats(str(path))


def main(argv: list[str] | None = None) -> int:
    def add_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--standin-cost-us", type=float, required=True)
        p.add_argument("--standin-profile", type=Path, default=None)

    def make_engine(known: argparse.Namespace, settings: WorkerSettings) -> StandinEngine:
        return StandinEngine(known.standin_cost_us)

    def around(known: argparse.Namespace, run: Callable[[], int]) -> int:
        if known.standin_profile is None:
            return run()
        profiles = ThreadProfiles()
        profiles.start()
        try:
            return run()
        finally:
            profiles.dump(known.standin_profile)

    return run_with_engine(argv, "standin_engine", add_args, make_engine, around)


if __name__ == "__main__":
    sys.exit(main())
