"""The demo's table shows the winning option and its probability first, however long the list."""

from __future__ import annotations

from engine.decide.answers import answer_for
from prism_pipeline.cli.demo import _fmt_answer, render_table
from schemas.systemone import Question


def _row(answer) -> str:
    shown, probs = _fmt_answer(answer)
    table = render_table(
        [
            {
                "event": "e",
                "question": "q",
                "type": "t",
                "answer": shown,
                "probabilities": probs,
                "thought": "-",
            }
        ]
    )
    return table.splitlines()[2]


def test_long_choice_list_keeps_the_winner_visible() -> None:
    options = {f"option_number_{i:02d}": None for i in range(40)}
    probs = [0.5 / 39] * 40
    probs[33] = 0.5
    q = Question.model_validate({"type": "choice", "criteria": options})
    answer = answer_for(q, probs)
    row = _row(answer)
    assert "option_number_33 0.50" in row  # the winner and its probability, not clipped away


def test_yes_no_and_score_show_the_winner() -> None:
    noul = answer_for(Question.model_validate({"type": "noul"}), [0.2, 0.8])
    assert "no 0.80" in _row(noul)
    levels = ["informational", "low", "medium", "high", "page now"]
    score = answer_for(
        Question.model_validate({"type": "score", "criteria": levels}), [0.0, 0.1, 0.2, 0.6, 0.1]
    )
    row = _row(score)
    assert "(3 0.60: high)" in row and row.split()[3] == "2.70"
