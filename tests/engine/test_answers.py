"""SystemOne answers from final probabilities: confidence formulas against hand-computed
values and against a direct transcription of DESIGN §1, plus the wire models' own checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.decide.answers import (
    answer_for,
    choice_answer,
    choice_confidence,
    max_probability,
    noul_answer,
    option_labels,
    score_answer,
    score_confidence,
)
from engine.decide.readout import read_letters, run_choice_rounds
from schemas.systemone import ChoiceAnswer, NoulAnswer, Question, ScoreAnswer


def distributions(min_size: int, max_size: int):
    """Normalised vectors from positive weights (some tiny) with sums exactly near 1."""
    weights = st.lists(st.floats(1e-9, 1.0), min_size=min_size, max_size=max_size)
    return weights.map(lambda w: [x / math.fsum(w) for x in w])


# ---- confidence formulas ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        ([0.5, 0.3, 0.2], 0.25),  # (0.5 - 1/3) / (2/3)
        ([0.5, 0.5], 0.0),
        ([1.0, 0.0, 0.0, 0.0], 1.0),
        ([0.25] * 4, 0.0),
        ([0.7, 0.1, 0.1, 0.1], 0.6),  # (0.7 - 0.25) / 0.75
    ],
)
def test_choice_confidence_hand_computed(p, expected):
    assert choice_confidence(p) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        ([0.8, 0.2], 0.6),  # D = 0.2, U = 0.5
        ([0.5, 0.5], 0.0),  # D = 0.5 = U
        ([0.2, 0.6, 0.2], 0.4),  # D = 0.4, U = 2/3
        ([0.1, 0.2, 0.6, 0.1], 0.5),  # mode 2: D = 0.2 + 0.2 + 0.1, U = (1.5 + .5 + .5 + 1.5) / 4
        ([0.0, 0.0, 1.0, 0.0, 0.0], 1.0),
        ([0.2] * 5, 0.0),  # mode 0: D = 2, U = 1.2: negative, floored
        ([0.0, 0.5, 0.0, 0.0, 0.5], 0.0),  # mode 1: D = 1.5 > U = 1.2
        ([0.1, 0.0, 0.0, 0.9], 0.7),  # mode 3: D = 0.1 · 3, U = 1.0
    ],
)
def test_score_confidence_hand_computed(p, expected):
    assert score_confidence(p) == pytest.approx(expected, abs=1e-12)


@given(distributions(2, 10))
def test_score_confidence_matches_definition(p):
    n = len(p)
    mode = max(range(n), key=lambda i: (p[i], -i))
    d = sum(p[i] * abs(i - mode) for i in range(n))
    u = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    assert score_confidence(p) == pytest.approx(max(0.0, 1.0 - d / u), abs=1e-12)
    assert 0.0 <= score_confidence(p) <= 1.0


@given(distributions(2, 255))
def test_choice_confidence_matches_definition(p):
    n = len(p)
    expected = (max(p) - 1 / n) / (1 - 1 / n)
    assert choice_confidence(p) == pytest.approx(min(1.0, max(0.0, expected)), abs=1e-12)
    assert max_probability(p) == max(p)


# ---- answers ---------------------------------------------------------------------------------


def test_noul_is_p_yes():
    a = noul_answer([0.7, 0.3])
    assert isinstance(a, NoulAnswer) and a.noul == 0.7
    assert "confidence" not in a.model_dump()


def test_choice_answer_fields_and_ties():
    a = choice_answer(["refund", "bug", "other"], [0.4, 0.4, 0.2])
    assert isinstance(a, ChoiceAnswer)
    assert a.choice == "refund"  # tie → first in display order
    assert list(a.probabilities) == ["refund", "bug", "other"]
    assert a.probabilities == {"refund": 0.4, "bug": 0.4, "other": 0.2}
    assert a.confidence == pytest.approx((0.4 - 1 / 3) / (2 / 3))
    b = choice_answer(["x", "y", "z"], [0.1, 0.3, 0.6], confidence="max_probability")
    assert b.choice == "z" and b.confidence == 0.6


def test_score_answer_fields():
    levels = ["none", "minor", "major", "critical"]
    a = score_answer(levels, [0.1, 0.2, 0.6, 0.1])
    assert isinstance(a, ScoreAnswer)
    assert a.score == pytest.approx(0.2 + 1.2 + 0.3)
    assert a.confidence == pytest.approx(0.5)
    assert a.legend == {"0": "none", "1": "minor", "2": "major", "3": "critical"}
    assert a.probabilities == {"0": 0.1, "1": 0.2, "2": 0.6, "3": 0.1}
    assert score_answer(levels, [0.1, 0.2, 0.6, 0.1], confidence="max_probability").confidence == 0.6


@given(distributions(2, 10))
def test_score_is_expected_level(p):
    a = score_answer([f"level {i}" for i in range(len(p))], p)
    assert a.score == pytest.approx(sum(i * x for i, x in enumerate(p)), abs=1e-12)
    assert abs(math.fsum(a.probabilities.values()) - 1.0) <= 1e-6


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: noul_answer([0.2, 0.3, 0.5]), "2 options"),
        (lambda: noul_answer([0.2, 0.2]), "sum"),
        (lambda: choice_answer(["a", "b"], [0.2, 0.3, 0.5]), "2 choice options but 3"),
        (lambda: choice_answer(["a", "a"], [0.5, 0.5]), "duplicates"),
        (lambda: choice_answer(["a"], [1.0]), "at least 2"),
        (lambda: choice_answer(["a", "b"], [0.5, float("nan")]), "finite"),
        (lambda: choice_answer(["a", "b"], [1.5, -0.5]), ">= 0"),
        (lambda: choice_answer(["a", "b"], [0.5, 0.5], confidence="entropy"), "confidence mode"),
        (lambda: score_answer(["lo", "hi"], [0.5, 0.4]), "sum"),
        (lambda: score_answer(["lo"], [1.0]), "at least 2"),
        (lambda: score_answer(["lo", "hi"], [0.2, 0.3, 0.5]), "2 score levels but 3"),
    ],
)
def test_bad_input_is_a_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_answer_for_questions():
    noul = Question(type="noul")
    choice = Question(type="choice", criteria={"refund": "money back", "bug": None, "other": None})
    score = Question(type="score", criteria=["low", "mid", "high"])
    assert option_labels(noul) == ["yes", "no"]
    assert option_labels(choice) == ["refund", "bug", "other"]
    assert option_labels(score) == ["low", "mid", "high"]
    assert answer_for(noul, [0.9, 0.1]) == noul_answer([0.9, 0.1])
    assert answer_for(choice, [0.2, 0.5, 0.3]).choice == "bug"
    s = answer_for(score, [0.2, 0.5, 0.3], confidence="max_probability")
    assert s.legend == {"0": "low", "1": "mid", "2": "high"} and s.confidence == 0.5


def test_from_logits_to_answer_end_to_end():
    # a read-out feeds an answer whose probabilities sum to 1 within 1e-6
    logits = torch.linspace(-3.0, 3.0, 50)
    ro = read_letters(logits, [40, 45, 49, 3], 0.8)
    a = choice_answer(["w", "x", "y", "z"], ro.probabilities)
    assert a.choice == "y" and abs(math.fsum(a.probabilities.values()) - 1.0) <= 1e-6

    n = 255
    names = [f"opt{i}" for i in range(n)]
    latent = torch.sin(torch.arange(n, dtype=torch.float32)) * 4.0

    def read(groups):
        out = []
        for g in groups:
            vocab = torch.zeros(64)
            vocab[10 : 10 + len(g)] = latent[g]
            out.append(read_letters(vocab, list(range(10, 10 + len(g))), 1.0))
        return out

    rounds = run_choice_rounds(n, read)
    a = choice_answer(names, rounds.probabilities)
    assert a.choice == names[rounds.final_choice]
    assert all(v > 0.0 for v in a.probabilities.values())
    assert abs(math.fsum(a.probabilities.values()) - 1.0) <= 1e-6
