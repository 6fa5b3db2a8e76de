"""`prism eval`: score a model on a labelled JSONL set through one or more precision paths.

Why: a decision model is only as good as its answers on questions whose answers are known, and
a precision path (int8, bf16) is only as good as its agreement with the fp32 reference. This
runs the same labelled set through every path asked for and reports, per path: accuracy per
question type (first read-out and final answer), calibration (expected calibration error over
10 equal-width confidence bins, and a reliability diagram), how often the AutoThink gate fires
and how accuracy on those questions changes after thinking, thought lengths (p50/p99) and how
many thoughts ran out of budget without `</think>`; across paths: answer agreement, and the
cross-read matrix - the thoughts path A wrote, read back by path B (`Engine.read_with_thought`),
for every ordered pair - plus how many of A's thoughts differ token for token from B's.

A labelled line is an evidence event (`request` with `state` and `questions`, an `event_id`)
plus `labels`: question id -> the right option id (`yes`/`no` for noul, the option key for
choice, the level index as a string `"0".."n-1"` for score). `prism_pipeline.synth` writes such
files; its hold-out (seed 1) is the default set.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog
from pydantic import ValidationError

from engine.decide.readout import first_argmax as _argmax  # ties go to the earliest option, as answers do
from prism_pipeline.core.seeds import derive_seed
from schemas.systemone import SystemOneRequest

log = structlog.get_logger(__name__)

PATHS = ("fp32", "int8", "bf16")
BINS = 10


class EvalError(ValueError):
    """The labelled set or the settings cannot be evaluated; the message says where."""


@dataclass(frozen=True)
class Item:
    """One labelled event: its id, the request, and question id -> right option id."""

    event_id: str
    request: SystemOneRequest
    labels: dict[str, str]


def _options(question: Any) -> list[str]:
    if question.type == "noul":
        return ["yes", "no"]
    if question.type == "score":
        return [str(i) for i in range(len(question.criteria))]
    return list(question.criteria)


def parse_items(lines: Sequence[bytes], source: str = "input") -> list[Item]:
    """Labelled events from JSON lines; EvalError names the line and field of the first problem."""
    items: list[Item] = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{source}:{n}"
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise EvalError(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict) or "request" not in obj or "labels" not in obj:
            raise EvalError(f"{where}: a labelled line is an object with 'request' and 'labels'")
        try:
            request = SystemOneRequest.model_validate(obj["request"])
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise EvalError(f"{where}: request.{loc}: {first['msg']}") from None
        labels = obj["labels"]
        if not isinstance(labels, dict) or not labels:
            raise EvalError(f"{where}: labels must be a non-empty object question id -> option id")
        for qid, label in labels.items():
            question = request.questions.get(qid)
            if question is None:
                raise EvalError(f"{where}: labels name question {qid!r}, which the request does not ask")
            if not isinstance(label, str) or label not in _options(question):
                raise EvalError(
                    f"{where}: label {label!r} of {qid!r} is not one of its options {_options(question)}"
                )
        event_id = obj.get("event_id") if isinstance(obj.get("event_id"), str) else f"line-{n}"
        items.append(Item(event_id, request, dict(labels)))
    if not items:
        raise EvalError(f"{source}: no labelled events")
    return items


def load_items(path: Path) -> list[Item]:
    try:
        return parse_items(path.read_bytes().splitlines(), str(path))
    except OSError as e:
        raise EvalError(f"cannot read {path}: {e}") from None


def holdout_items(n_events: int = 300, seed: int = 1) -> list[Item]:
    """The generator's hold-out (another seed than the demo model's training set)."""
    from prism_pipeline import synth

    return parse_items([orjson.dumps(e) for e in synth.generate(n_events, seed, "holdout")], "holdout")


# ------------------------------------------------------------------------------------ one path
@dataclass
class Answered:
    """One labelled question as one path answered it."""

    event: int
    qid: str
    type: str
    label: int  # index of the right option
    first: list[float]
    final: list[float]
    thought: list[int] | None  # token ids, when the gate fired
    truncated: bool = False

    @property
    def correct(self) -> bool:
        return _argmax(self.final) == self.label

    @property
    def first_correct(self) -> bool:
        return _argmax(self.first) == self.label


def run_path(
    engine: Any, items: list[Item], batch_events: int = 64, progress: Callable[[int, int], None] | None = None
) -> list[Answered]:
    """Decide every item on `engine` (seeds derived from event ids, as `prism run` does)."""
    from engine.types import DecideRequest

    out: list[Answered] = []
    for start in range(0, len(items), batch_events):
        chunk = items[start : start + batch_events]
        reqs = [DecideRequest(it.event_id, it.request, seed=derive_seed(it.event_id)) for it in chunk]
        for k, (it, res) in enumerate(zip(chunk, engine.decide(reqs), strict=True)):
            if res.error is not None:
                raise EvalError(f"event {it.event_id}: the engine could not answer: {res.error}")
            for qid, label in it.labels.items():
                trace = res.traces[qid]
                question = it.request.questions[qid]
                out.append(
                    Answered(
                        event=start + k,
                        qid=qid,
                        type=question.type,
                        label=_options(question).index(label),
                        first=list(trace.first.probabilities),
                        final=list(trace.final_probabilities),
                        thought=res.thought_ids.get(qid) if trace.second is not None else None,
                        truncated=trace.thought_truncated,
                    )
                )
        if progress is not None:
            progress(min(start + batch_events, len(items)), len(items))
    return out


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (None for no values)."""
    if not values:
        return None
    s = sorted(values)
    return float(s[max(0, math.ceil(q * len(s)) - 1)])


def calibration(answers: Sequence[Answered], bins: int = BINS) -> dict[str, Any]:
    """Expected calibration error of the final answer's top probability, and the diagram's bins."""
    counts = [0] * bins
    conf = [0.0] * bins
    hits = [0] * bins
    for a in answers:
        top = max(a.final)
        b = min(bins - 1, int(top * bins))
        counts[b] += 1
        conf[b] += top
        hits[b] += a.correct
    n = len(answers)
    ece = sum(abs(hits[b] - conf[b]) for b in range(bins)) / n if n else 0.0
    return {
        "ece": ece,
        "bins": [
            {
                "low": b / bins,
                "high": (b + 1) / bins,
                "count": counts[b],
                "confidence": conf[b] / counts[b] if counts[b] else None,
                "accuracy": hits[b] / counts[b] if counts[b] else None,
            }
            for b in range(bins)
        ],
    }


def path_summary(answers: Sequence[Answered]) -> dict[str, Any]:
    """Accuracy per type, calibration, the gate, thoughts (one path)."""
    by_type: dict[str, dict[str, Any]] = {}
    for t in ("noul", "choice", "score"):
        sel = [a for a in answers if a.type == t]
        if sel:
            by_type[t] = {
                "questions": len(sel),
                "accuracy": sum(a.correct for a in sel) / len(sel),
                "first_accuracy": sum(a.first_correct for a in sel) / len(sel),
            }
    thought = [a for a in answers if a.thought is not None]
    lengths = [float(len(a.thought)) for a in thought if a.thought is not None]
    n = len(answers)
    return {
        "questions": n,
        "accuracy": sum(a.correct for a in answers) / n,
        "first_accuracy": sum(a.first_correct for a in answers) / n,
        "by_type": by_type,
        "calibration": calibration(answers),
        "gate": {
            "fired": len(thought),
            "share": len(thought) / n,
            "accuracy_before": sum(a.first_correct for a in thought) / len(thought) if thought else None,
            "accuracy_after": sum(a.correct for a in thought) / len(thought) if thought else None,
        },
        "thoughts": {
            "p50_tokens": _quantile(lengths, 0.5),
            "p99_tokens": _quantile(lengths, 0.99),
            "max_tokens": max(lengths) if lengths else None,
            "unclosed": sum(a.truncated for a in thought),  # budget ran out before </think>
        },
    }


def agreement(a: Sequence[Answered], b: Sequence[Answered]) -> dict[str, Any]:
    """Share of questions both paths answer alike, and the largest probability difference."""
    same = sum(_argmax(x.final) == _argmax(y.final) for x, y in zip(a, b, strict=True))
    diff = max(
        (abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x.final, y.final, strict=True)),
        default=0.0,
    )
    return {"agree": same / len(a), "max_abs_probability_diff": diff}


def cross_read(
    writer: Sequence[Answered],
    reader_engine: Any,
    reader_answers: Sequence[Answered],
    items: list[Item],
    chunk: int = 64,
) -> dict[str, Any]:
    """The thoughts `writer` wrote, read by `reader_engine`: accuracy of that read-out, and how
    many of those thoughts differ from the reader's own thought on the same question."""
    pairs = [(w, r) for w, r in zip(writer, reader_answers, strict=True) if w.thought is not None]
    correct = differ = both = 0
    for start in range(0, len(pairs), chunk):
        part = pairs[start : start + chunk]
        reads = [(items[w.event].request, w.qid, w.thought or []) for w, _ in part]
        for (w, r), ro in zip(part, reader_engine.read_with_thoughts(reads), strict=True):
            correct += _argmax(ro.probabilities) == w.label
            if r.thought is not None:
                both += 1
                differ += r.thought != w.thought
    n = len(pairs)
    return {
        "thoughts": n,
        "correct": correct,
        "accuracy": correct / n if n else None,
        "reader_also_thought": both,
        "differ_from_reader_thought": differ,
    }


# ------------------------------------------------------------------------------------ the report
@dataclass
class EvalReport:
    model: str
    set_name: str
    events: int
    paths: dict[str, dict[str, Any]] = field(default_factory=dict)
    agreement: dict[str, dict[str, Any]] = field(default_factory=dict)  # "a/b" -> agreement
    cross_read: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # writer -> reader ->
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def evaluate(
    model: Path,
    items: list[Item],
    paths: Sequence[str] = ("fp32", "int8"),
    *,
    set_name: str = "",
    gate: float | None = None,
    thought_budget: int | None = None,
    load: Callable[[Path, str, Any], Any] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    batch_events: int = 64,
) -> EvalReport:
    """Run `items` through every path and compare them (see the module docstring)."""
    bad = [p for p in paths if p not in PATHS]
    if bad or not paths:
        raise EvalError(f"precision paths must be some of {', '.join(PATHS)}, got {list(paths)}")
    if len(set(paths)) != len(paths):
        raise EvalError(f"a precision path is named twice: {list(paths)}")
    from prism_pipeline.core.engine_setup import EngineSettings, decision_config_for, load_engine

    settings = EngineSettings(model=model, gate=gate, thought_budget=thought_budget)
    config = decision_config_for(settings)  # the gate and budget as every command applies them
    if load is None:

        def load(path: Path, precision: str, dc: Any) -> Any:
            path_settings = settings.model_copy(update={"model": path, "precision": precision})
            return load_engine(path_settings, decision_config=dc, mmproj=False, watch=False)

    report = EvalReport(model=str(model), set_name=set_name, events=len(items))
    engines: dict[str, Any] = {}
    answers: dict[str, list[Answered]] = {}
    for p in paths:
        t0 = time.perf_counter()
        engines[p] = load(model, p, config)
        answers[p] = run_path(
            engines[p],
            items,
            batch_events=batch_events,
            progress=(lambda d, t, p=p: progress(p, d, t)) if progress else None,
        )
        report.paths[p] = path_summary(answers[p])
        report.seconds[p] = round(time.perf_counter() - t0, 2)
        log.info(
            "eval.path_done",
            path=p,
            accuracy=round(report.paths[p]["accuracy"], 4),
            seconds=report.seconds[p],
        )
    for i, a in enumerate(paths):
        for b in paths[i + 1 :]:
            report.agreement[f"{a}/{b}"] = agreement(answers[a], answers[b])
    t0 = time.perf_counter()
    for a in paths:
        report.cross_read[a] = {b: cross_read(answers[a], engines[b], answers[b], items) for b in paths}
    report.seconds["cross_read"] = round(time.perf_counter() - t0, 2)
    return report
