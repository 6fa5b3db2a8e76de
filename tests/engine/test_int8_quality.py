"""Quality of the int8 path against the fp32 oracle on the tiny test model with planted outliers.

fp32 runs the F32 file; int8 runs the Q8_0 file of the same weights (so the error measured is
Q8_0 storage + W8A8 requantization + per-token activation quantization). 520 questions on 20
evidences. Asserted: argmax agreement >= 95% on questions whose fp32 top-two margin is >= 0.1,
and SmoothQuant (alpha 0.5) has a lower mean |dp| than plain per-token int8 (alpha 0).

    .venv/bin/python tests/engine/test_int8_quality.py    # prints the numbers for ops/bench/RESULTS.md
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

N_EVIDENCE, QUESTIONS_PER_EVIDENCE = 20, 26
OUTLIERS = 4
SERVICES = ["checkout-api", "search", "payments-gateway", "orders-worker", "auth", "ranker", "pg-primary-02"]
ALERTS = ["HighCPUUsage", "DiskWillFillIn4Hours", "PodCrashLooping", "ReplicationLagHigh", "5xxRateHigh"]


def question_set(seed: int = 0) -> list[DecideRequest]:
    """N_EVIDENCE requests x QUESTIONS_PER_EVIDENCE typed questions, AutoThink off."""
    rng = random.Random(seed)
    out = []
    for e in range(N_EVIDENCE):
        state = {
            "alert": rng.choice(ALERTS),
            "service": rng.choice(SERVICES),
            "value": f"{rng.randint(50, 99)}%",
            "duration": f"{rng.randint(1, 90)}m",
            "note": " ".join(rng.choice(SERVICES + ALERTS) for _ in range(rng.randint(0, 12))),
        }
        questions: dict[str, Any] = {}
        for q in range(QUESTIONS_PER_EVIDENCE):
            kind = q % 3
            if kind == 0:
                questions[f"q{q}"] = {"type": "noul", "instructions": f"Is {rng.choice(SERVICES)} at fault?"}
            elif kind == 1:
                n = rng.randint(2, 6)
                questions[f"q{q}"] = {
                    "type": "choice",
                    "instructions": "Which team owns it?",
                    "criteria": {rng.choice(SERVICES) + f"-{j}": None for j in range(n)},
                }
            else:
                n = rng.randint(2, 5)
                questions[f"q{q}"] = {
                    "type": "score",
                    "instructions": "Severity?",
                    "criteria": [f"s{j}" for j in range(n)],
                }
        request = SystemOneRequest.model_validate({"state": state, "questions": questions})
        out.append(DecideRequest(f"quality-{e}", request, gate=0.0))
    return out


def probabilities(engine: Engine, requests: list[DecideRequest]) -> list[list[float]]:
    results = engine.decide(requests)
    return [list(t.first.probabilities) for r in results for t in r.traces.values()]  # type: ignore[union-attr]


@dataclass(frozen=True)
class Agreement:
    questions: int
    argmax_agree: float  # fraction of all questions
    confident: int  # questions with an fp32 top-two margin >= 0.1
    confident_agree: float
    mean_abs_dp: float  # mean over questions of the mean |dp| over options
    max_abs_dp: float


def compare(reference: list[list[float]], other: list[list[float]]) -> Agreement:
    agree = confident = confident_agree = 0
    mean_dp, max_dp = 0.0, 0.0
    for p, q in zip(reference, other, strict=True):
        same = max(range(len(p)), key=p.__getitem__) == max(range(len(q)), key=q.__getitem__)
        agree += same
        top = sorted(p, reverse=True)
        if top[0] - top[1] >= 0.1:
            confident += 1
            confident_agree += same
        diffs = [abs(a - b) for a, b in zip(p, q, strict=True)]
        mean_dp += sum(diffs) / len(diffs)
        max_dp = max(max_dp, *diffs)
    n = len(reference)
    return Agreement(n, agree / n, confident, confident_agree / max(confident, 1), mean_dp / n, max_dp)


def measure(f32_path: Path, q8_path: Path) -> dict[str, Agreement]:
    requests = question_set()
    fp32 = probabilities(Engine.load(f32_path, precision="fp32"), requests)
    out = {}
    for alpha in (0.5, 0.0):
        engine = Engine.load(q8_path, precision="int8", smooth_alpha=alpha)
        out[f"int8 alpha={alpha}"] = compare(fp32, probabilities(engine, requests))
    return out


@pytest.mark.slow
def test_int8_tracks_fp32_and_smoothquant_beats_plain_int8(gguf_model: Callable[..., Path]) -> None:
    numbers = measure(
        gguf_model("F32", "tiny", 0, False, OUTLIERS), gguf_model("Q8_0", "tiny", 0, False, OUTLIERS)
    )
    smooth, plain = numbers["int8 alpha=0.5"], numbers["int8 alpha=0.0"]
    assert smooth.questions >= 500
    assert smooth.confident >= 50, "too few confident questions for the agreement check to mean anything"
    assert smooth.confident_agree >= 0.95, smooth
    assert smooth.mean_abs_dp < plain.mean_abs_dp, (smooth, plain)


def main() -> None:
    import tempfile

    from engine.testing.make_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        for outliers in (OUTLIERS, 0):
            f32 = make_model(Path(tmp) / f"f32-{outliers}.gguf", "F32", "tiny", 0, outliers=outliers)
            q8 = make_model(Path(tmp) / f"q8-{outliers}.gguf", "Q8_0", "tiny", 0, outliers=outliers)
            print(f"\n### tiny model, seed 0, outliers={outliers}: int8 (Q8_0 file) vs fp32 (F32 file)\n")
            print(
                "| path | questions | argmax agree | margin>=0.1 | agree there | mean abs dp | max abs dp |"
            )
            print("|---|---|---|---|---|---|---|")
            for name, a in measure(f32, q8).items():
                print(
                    f"| {name} | {a.questions} | {a.argmax_agree:.4f} | {a.confident} "
                    f"| {a.confident_agree:.4f} | {a.mean_abs_dp:.5f} | {a.max_abs_dp:.5f} |"
                )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
