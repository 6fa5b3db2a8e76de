"""SystemOne answers from a question's final option probabilities (DESIGN §1).

- noul: options [yes, no] shown as A, B; the answer is P(yes). No confidence field.
- choice: the argmax option (ties → first in display order);
  confidence = (p_max − 1/n) / (1 − 1/n).
- score: score = Σ i·p_i over levels 0..n−1;
  confidence = 1 − D / U, floored at 0, where
      mode = argmax_i p_i (ties → the lowest level),
      D    = Σ_i p_i·|i − mode|            (expected distance from the mode),
      U    = Σ_i (1/n)·|i − (n − 1)/2|     (the same for a uniform spread, measured from the
                                            middle level),
  so a point mass gives 1 and a uniform spread gives at most 0.
- `confidence="max_probability"` replaces both confidences with p_max (qev's statistic).

Every value handed to the wire models is clamped to [0, 1] against float rounding only;
inputs must already sum to 1 within 1e-6.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engine.decide.decision_config import CONFIDENCE_MODES, ConfidenceMode
from engine.decide.readout import check_probabilities, first_argmax
from schemas.systemone import Answer, ChoiceAnswer, NoulAnswer, Question, ScoreAnswer

NOUL_OPTIONS = ("yes", "no")  # display order: A) yes, B) no


def _unit(x: float) -> float:
    return min(1.0, max(0.0, x))


def _check_mode(mode: str) -> None:
    if mode not in CONFIDENCE_MODES:
        raise ValueError(f"confidence mode must be one of {', '.join(CONFIDENCE_MODES)}, got {mode!r}")


def _check_names(what: str, names: Sequence[str]) -> list[str]:
    out = list(names)
    if len(out) < 2:
        raise ValueError(f"{what}: need at least 2, got {len(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: duplicates {sorted({o for o in out if out.count(o) > 1})}")
    return out


def max_probability(probabilities: Sequence[float]) -> float:
    return _unit(max(check_probabilities("probabilities", probabilities)))


def choice_confidence(probabilities: Sequence[float]) -> float:
    """(p_max − 1/n) / (1 − 1/n): 0 for a uniform spread, 1 for a point mass."""
    p = check_probabilities("choice probabilities", probabilities)
    n = len(p)
    if n < 2:
        raise ValueError(f"choice confidence needs at least 2 options, got {n}")
    return _unit((max(p) - 1.0 / n) / (1.0 - 1.0 / n))


def score_confidence(probabilities: Sequence[float]) -> float:
    """1 − D/U floored at 0 (module docstring): D is the expected distance from the mode,
    U the expected distance of a uniform spread from the middle level (n − 1)/2."""
    p = check_probabilities("score probabilities", probabilities)
    n = len(p)
    if n < 2:
        raise ValueError(f"score confidence needs at least 2 levels, got {n}")
    mode = first_argmax(p)
    mid = (n - 1) / 2.0
    spread = math.fsum(p_i * abs(i - mode) for i, p_i in enumerate(p))
    uniform = math.fsum(abs(i - mid) for i in range(n)) / n  # > 0 for n >= 2
    return _unit(1.0 - spread / uniform)


def noul_answer(probabilities: Sequence[float]) -> NoulAnswer:
    """From the [P(A = yes), P(B = no)] read-out."""
    p = check_probabilities("noul probabilities", probabilities)
    if len(p) != 2:
        raise ValueError(f"a noul read-out has 2 options (yes, no), got {len(p)}")
    return NoulAnswer(type="noul", noul=_unit(p[0]))


def choice_answer(
    options: Sequence[str], probabilities: Sequence[float], *, confidence: ConfidenceMode = "startlux"
) -> ChoiceAnswer:
    """`options` are the option ids in display order, aligned with `probabilities`."""
    _check_mode(confidence)
    names = _check_names("choice options", options)
    p = check_probabilities("choice probabilities", probabilities)
    if len(p) != len(names):
        raise ValueError(f"{len(names)} choice options but {len(p)} probabilities")
    conf = choice_confidence(p) if confidence == "startlux" else max_probability(p)
    return ChoiceAnswer(
        type="choice",
        choice=names[first_argmax(p)],
        confidence=conf,
        probabilities={name: _unit(v) for name, v in zip(names, p, strict=True)},
    )


def score_answer(
    levels: Sequence[str], probabilities: Sequence[float], *, confidence: ConfidenceMode = "startlux"
) -> ScoreAnswer:
    """`levels` are the level descriptions, lowest first, aligned with `probabilities`."""
    _check_mode(confidence)
    texts = list(levels)
    if len(texts) < 2:
        raise ValueError(f"score levels: need at least 2, got {len(texts)}")
    p = check_probabilities("score probabilities", probabilities)
    if len(p) != len(texts):
        raise ValueError(f"{len(texts)} score levels but {len(p)} probabilities")
    score = min(float(len(p) - 1), max(0.0, math.fsum(i * v for i, v in enumerate(p))))
    conf = score_confidence(p) if confidence == "startlux" else max_probability(p)
    return ScoreAnswer(
        type="score",
        score=score,
        confidence=conf,
        legend={str(i): text for i, text in enumerate(texts)},
        probabilities={str(i): _unit(v) for i, v in enumerate(p)},
    )


def option_labels(question: Question) -> list[str]:
    """What each read-out position stands for, in display order: yes/no, option ids, or
    score level texts."""
    criteria: Any = question.criteria
    return list(NOUL_OPTIONS) if question.type == "noul" else list(criteria)


def answer_for(
    question: Question, probabilities: Sequence[float], *, confidence: ConfidenceMode = "startlux"
) -> Answer:
    """The wire answer for a validated question from its final probabilities."""
    if question.type == "noul":
        return noul_answer(probabilities)
    if question.type == "choice":
        return choice_answer(list(question.criteria), probabilities, confidence=confidence)
    return score_answer(list(question.criteria), probabilities, confidence=confidence)
