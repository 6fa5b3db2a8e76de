"""`prism eval` on a tiny labelled set, and the engine's read-with-thought API it relies on.

Oracles: labels set from the plain reference forward of each whole prompt (`Engine.logits`,
not the forest `decide` runs), hand-computed calibration error, and `decide`'s own second
read-out for the thought it wrote.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import orjson
import pytest

from engine.decide.decision_config import DecisionConfig
from engine.model.prompt import PromptEncoder
from engine.types import DecideRequest
from prism_pipeline import synth
from prism_pipeline.cli import build_parser
from prism_pipeline.evaluate import Answered, EvalError, calibration, evaluate, parse_items


def _events(n: int) -> list[dict]:
    return list(synth.generate(n, seed=7, split="test"))


def _reference_argmax(engine, event: dict, qid: str) -> int:
    """The first read-out's top option from a plain forward of the whole prompt."""
    prompts = PromptEncoder(engine.tokenizer)
    question = event["request"]["questions"][qid]
    rendered = prompts.render(event["request"]["state"], question)
    logits = engine.logits(rendered.token_ids)[-1]
    letters = prompts.letter_token_ids(len(rendered.option_ids))
    row = [float(logits[t]) for t in letters]
    return max(range(len(row)), key=lambda i: (row[i], -i))


def test_labels_from_the_reference_forward_score_all_and_none(tiny_engine, tiny_model: Path) -> None:
    events = _events(3)
    right, wrong = [], []
    for e in events:
        best = {}
        for qid, q in e["request"]["questions"].items():
            options = synth._options(q)
            top = _reference_argmax(tiny_engine, e, qid)
            best[qid] = (options[top], options[(top + 1) % len(options)])
        right.append({**e, "labels": {k: v[0] for k, v in best.items()}})
        wrong.append({**e, "labels": {k: v[1] for k, v in best.items()}})
    n_questions = sum(len(e["labels"]) for e in right)

    def load(path, precision, dc):
        return tiny_engine

    for rows, expected in ((right, 1.0), (wrong, 0.0)):
        items = parse_items([orjson.dumps(r) for r in rows])
        report = evaluate(tiny_model, items, ["fp32"], gate=0.0, load=load)
        s = report.paths["fp32"]
        assert s["questions"] == n_questions
        assert s["first_accuracy"] == expected and s["accuracy"] == expected
        assert sum(t["questions"] for t in s["by_type"].values()) == n_questions
        assert s["gate"]["fired"] == 0


def test_calibration_error_by_hand() -> None:
    def a(top: float, correct: bool) -> Answered:
        probs = [top, 1 - top]
        return Answered(0, "q", "noul", 0 if correct else 1, probs, probs, None)

    # bin 9: confidences 0.95, 0.95, one right -> |1 - 1.9|; bin 6: 0.6 right -> |1 - 0.6|
    cal = calibration([a(0.95, True), a(0.95, False), a(0.6, True)])
    assert math.isclose(cal["ece"], (0.9 + 0.4) / 3)
    assert cal["bins"][9]["count"] == 2 and cal["bins"][9]["accuracy"] == 0.5
    assert cal["bins"][6]["count"] == 1 and cal["bins"][0]["count"] == 0


def test_read_with_thought_matches_decides_second_readout(tiny_model: Path) -> None:
    from engine.engine import Engine

    engine = Engine.load(
        tiny_model, precision="fp32", decision_config=DecisionConfig(gate=1.0, thought_budget=3)
    )
    items = parse_items([orjson.dumps(e) for e in _events(2)])
    reqs = [DecideRequest(it.event_id, it.request, seed=5) for it in items]
    for it, res in zip(items, engine.decide(reqs), strict=True):
        for qid, trace in res.traces.items():
            assert trace.second is not None and len(res.thought_ids[qid]) == trace.thought_tokens
            ro = engine.read_with_thought(it.request, qid, res.thought_ids[qid])
            assert ro.options == trace.second.options
            for p, q in zip(ro.probabilities, trace.second.probabilities, strict=True):
                assert abs(p - q) < 1e-5
    with pytest.raises(ValueError, match="no question"):
        engine.read_with_thought(items[0].request, "nope", [])


def test_eval_cli_writes_json_and_png(tiny_model: Path, tmp_path: Path, capsys) -> None:
    data = tmp_path / "set.jsonl"
    data.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in _events(2)))
    out = tmp_path / "out"
    args = build_parser().parse_args(
        ["eval", "--model", str(tiny_model), "--set", str(data), "--paths", "fp32,bf16",
         "--gate", "1", "--thought-budget", "2", "--out", str(out)]
    )  # fmt: skip
    rc = args.func(args)
    assert rc == 0
    text = capsys.readouterr().out
    assert "cross-read" in text and "agreement fp32/bf16" in text
    report = json.loads((out / "eval.json").read_text())
    n = sum(len(e["labels"]) for e in _events(2))
    for path in ("fp32", "bf16"):
        assert report["paths"][path]["questions"] == n
        assert report["paths"][path]["gate"]["fired"] == n  # gate 1: every question thinks
        assert report["paths"][path]["thoughts"]["p99_tokens"] <= 2
    # every ordered pair of paths reads every thought the writer wrote
    assert {w: {r: c["thoughts"] for r, c in row.items()} for w, row in report["cross_read"].items()} == {
        w: {r: n for r in ("fp32", "bf16")} for w in ("fp32", "bf16")
    }
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_labelled_lines_name_the_line() -> None:
    event = _events(1)[0]
    good = orjson.dumps(event)
    with pytest.raises(EvalError, match=r"input:2: label 'maybe'"):
        parse_items([good, orjson.dumps({**event, "labels": {"owner": "maybe"}})])
    with pytest.raises(EvalError, match=r"input:1: labels name question 'nope'"):
        parse_items([orjson.dumps({**event, "labels": {"nope": "yes"}})])
    with pytest.raises(EvalError, match=r"input:1: not JSON"):
        parse_items([b"{oops"])
    with pytest.raises(EvalError, match="precision paths"):
        evaluate(Path("m.gguf"), parse_items([good]), ["fp16"])
