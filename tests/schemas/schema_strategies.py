"""Hypothesis strategies producing valid wire objects (plain JSON-ready dicts and models)."""

from __future__ import annotations

import base64
import hashlib
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

from hypothesis import strategies as st

from schemas import DecisionRecord, EvidenceEvent

finite_floats = st.floats(allow_nan=False, allow_infinity=False)
# orjson reads integers in [-2**63, 2**64 - 1] as ints (and beyond as floats), so stay inside.
json_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
short_text = st.text(max_size=12)
printable = st.text(
    alphabet=st.characters(categories=["L", "M", "N", "P", "S"], include_characters=" "),
    min_size=1,
    max_size=24,
)
nonblank = st.text(min_size=1, max_size=16).filter(lambda s: s.strip() != "")

json_values = st.recursive(
    st.none() | st.booleans() | json_ints | finite_floats | short_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(short_text, inner, max_size=4),
    max_leaves=16,
)


def timezones() -> st.SearchStrategy[timezone]:
    return st.integers(min_value=-23 * 60, max_value=23 * 60).map(lambda m: timezone(timedelta(minutes=m)))


aware_datetimes = st.datetimes(
    min_value=datetime(1900, 1, 1), max_value=datetime(2999, 12, 31), timezones=timezones()
)


@st.composite
def questions(draw: st.DrawFn) -> dict[str, Any]:
    qtype = draw(st.sampled_from(["noul", "choice", "score"]))
    q: dict[str, Any] = {"type": qtype}
    if qtype == "choice":
        q["criteria"] = draw(st.dictionaries(nonblank, st.none() | short_text, min_size=2, max_size=12))
    elif qtype == "score":
        q["criteria"] = draw(st.lists(nonblank, min_size=2, max_size=10))
    else:
        keys = draw(st.sets(st.sampled_from(["true", "false"])))
        q["criteria"] = draw(
            st.none() | st.fixed_dictionaries({k: st.none() | short_text for k in sorted(keys)})
        )
    if draw(st.booleans()):
        q["instructions"] = draw(json_values)
    if draw(st.booleans()):
        q["gate"] = draw(st.floats(min_value=0.0, max_value=1.0))
    return q


@st.composite
def images(draw: st.DrawFn) -> str:
    data = base64.b64encode(draw(st.binary(min_size=1, max_size=48))).decode()
    mime = draw(st.sampled_from([None, "image/png", "image/jpeg", "IMAGE/WEBP"]))
    return data if mime is None else f"data:{mime};base64,{data}"


@st.composite
def requests(draw: st.DrawFn, max_questions: int = 5) -> dict[str, Any]:
    req: dict[str, Any] = {
        "state": draw(st.one_of(st.text(max_size=64), json_values)),
        "questions": draw(st.dictionaries(nonblank, questions(), min_size=1, max_size=max_questions)),
    }
    if draw(st.booleans()):
        req["model"] = draw(printable)
    if draw(st.booleans()):
        req["images"] = draw(st.lists(images(), max_size=3))
    return req


@st.composite
def event_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A valid event as the JSON-ready dict a producer would send."""
    ev: dict[str, Any] = {
        "event_id": draw(printable),
        "source": draw(st.sampled_from(["ticket", "alert", "other"])),
        "tenant": draw(printable),
        "created_at": draw(aware_datetimes).isoformat(),
        "request": draw(requests()),
    }
    if draw(st.booleans()):
        ev["seed"] = draw(st.integers(min_value=0, max_value=2**63 - 1))
    if draw(st.booleans()):
        ev["gate"] = draw(st.floats(min_value=0.0, max_value=1.0))
    if draw(st.booleans()):
        ev["thought_budget"] = draw(st.integers(min_value=1, max_value=65536))
    return ev


events = event_dicts().map(EvidenceEvent.model_validate)


@st.composite
def distributions(draw: st.DrawFn, n: int) -> list[float]:
    weights = draw(st.lists(st.floats(min_value=1e-3, max_value=1.0), min_size=n, max_size=n))
    total = sum(weights)
    return [w / total for w in weights]


@st.composite
def readouts(draw: st.DrawFn, options: list[str]) -> dict[str, Any]:
    letters = [chr(ord("A") + i) for i in range(min(len(options), 26))]
    rounds = [
        {
            "options": options[: len(letters)],
            "letters": letters,
            "logits": draw(st.lists(finite_floats, min_size=len(letters), max_size=len(letters))),
            "coverage": draw(st.floats(min_value=0.0, max_value=1.0)),
        }
    ]
    return {
        "options": options,
        "probabilities": draw(distributions(len(options))),
        "coverage": draw(st.floats(min_value=0.0, max_value=1.0)),
        "temperature": draw(st.floats(min_value=1e-3, max_value=10.0)),
        "rounds": rounds,
    }


@st.composite
def answer_and_trace(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    qtype = draw(st.sampled_from(["noul", "choice", "score"]))
    if qtype == "noul":
        options = ["yes", "no"]
    elif qtype == "choice":
        options = draw(st.lists(nonblank, min_size=2, max_size=30, unique=True))
    else:
        options = [str(i) for i in range(draw(st.integers(min_value=2, max_value=10)))]
    first = draw(readouts(options))
    second = draw(st.none() | readouts(options))
    final = draw(distributions(len(options)))
    probs = dict(zip(options, final, strict=True))
    confidence = draw(st.floats(min_value=0.0, max_value=1.0))
    if qtype == "noul":
        answer: dict[str, Any] = {"type": "noul", "noul": final[0]}
    elif qtype == "choice":
        answer = {"type": "choice", "choice": max(probs, key=probs.__getitem__), "confidence": confidence}
        answer["probabilities"] = probs
    else:
        score = min(sum(i * p for i, p in enumerate(final)), len(options) - 1.0)
        legend = {k: draw(nonblank) for k in options}
        answer = {
            "type": "score",
            "score": score,
            "confidence": confidence,
            "legend": legend,
            "probabilities": probs,
        }
    thought = draw(st.none() | st.text(max_size=40)) if second is not None else None
    trace = {
        "prompt_tokens": draw(st.integers(min_value=1, max_value=70_000)),
        "first": first,
        "second": second,
        "thought": thought,
        "thought_tokens": draw(st.integers(min_value=0, max_value=4096)) if thought is not None else 0,
        "thought_truncated": draw(st.booleans()) if thought is not None else False,
        "final_probabilities": final,
    }
    return answer, trace


def _digest(seed: bytes) -> str:
    return hashlib.sha256(seed).hexdigest()


@st.composite
def record_dicts(draw: st.DrawFn) -> dict[str, Any]:
    ids = draw(st.lists(nonblank, min_size=1, max_size=4, unique=True))
    pairs = [draw(answer_and_trace()) for _ in ids]
    rec: dict[str, Any] = {
        "record_version": 1,
        "event_id": draw(printable),
        "source": draw(st.sampled_from(["ticket", "alert", "other"])),
        "tenant": draw(printable),
        "created_at": draw(aware_datetimes).isoformat(),
        "model": {
            "name": draw(printable),
            "file_digest": _digest(draw(st.binary(max_size=8))),
            "engine_version": draw(printable),
            "precision": draw(st.sampled_from(["int8", "bf16", "fp32"])),
            "render_version": "jev_render_v3",
            "decision_config_digest": _digest(draw(st.binary(max_size=8))),
            "gate": draw(st.floats(min_value=0.0, max_value=1.0)),
            "thought_budget": draw(st.integers(min_value=0, max_value=65536)),
            "mix_weight": draw(st.floats(min_value=0.0, max_value=1.0)),
        },
        "seed": draw(st.integers(min_value=0, max_value=2**63 - 1)),
        "answers": {q: a for q, (a, _) in zip(ids, pairs, strict=True)},
        "questions": {q: t for q, (_, t) in zip(ids, pairs, strict=True)},
        "usage": {"input_tokens": draw(st.integers(0, 10**6)), "output_tokens": draw(st.integers(0, 10**5))},
        "input": draw(
            st.none()
            | st.fixed_dictionaries(
                {"topic": printable, "partition": st.integers(0, 1000), "offset": st.integers(0, 2**62)}
            )
        ),
    }
    return rec


records = record_dicts().map(DecisionRecord.model_validate)

UTC_NOON = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
