"""Every way an event can be invalid maps to its dead-letter reason and points at the offending field."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schema_strategies import event_dicts, json_ints, nonblank

from schemas import EvidenceEvent, InvalidEvent, Limits, ReasonCode, classify_invalid, parse_event
from schemas.deadletter import has_duplicate_keys

R = ReasonCode


def _reject(raw: bytes, limits: Limits | None = None) -> InvalidEvent:
    with pytest.raises(InvalidEvent) as info:
        parse_event(raw, limits)
    assert classify_invalid(raw, limits) is not None
    return info.value


def _locs(e: InvalidEvent) -> list[list[str | int]]:
    return [d.loc for d in e.errors]


def _with_raw_questions(ev: dict[str, Any], questions_json: bytes) -> bytes:
    """The event's bytes with request.questions replaced by hand-written JSON text."""
    marker = "\u2603questions-go-here\u2603"
    ev = copy.deepcopy(ev)
    ev["request"]["questions"] = marker
    return orjson.dumps(ev).replace(orjson.dumps(marker), questions_json)


# ---- hypothesis: one mutation of a valid event -> expected reason and loc ---------------------------


@st.composite
def mutations(draw: st.DrawFn) -> tuple[bytes, Limits | None, ReasonCode, list[str | int]]:
    ev = draw(event_dicts())
    qs = ev["request"]["questions"]
    qid = draw(st.sampled_from(sorted(qs)))
    kind = draw(
        st.sampled_from(
            [
                "unknown_type",
                "many_choice",
                "few_choice",
                "many_score",
                "few_score",
                "state_str",
                "state_json",
                "questions",
                "image",
                "too_many_images",
                "dup_question",
                "dup_envelope",
                "utf8",
                "json",
                "payload",
                "missing",
                "extra",
                "seed_type",
            ]
        )
    )
    if kind == "unknown_type":
        qs[qid]["type"] = draw(st.text(max_size=10).filter(lambda t: t not in ("noul", "choice", "score")))
        return orjson.dumps(ev), None, R.unknown_question_type, ["request", "questions", qid, "type"]
    if kind in ("many_choice", "few_choice"):
        n = draw(st.integers(256, 300) if kind == "many_choice" else st.integers(0, 1))
        qs[qid] = {"type": "choice", "criteria": {f"opt{i}": None for i in range(n)}}
        reason = R.too_many_options if kind == "many_choice" else R.too_few_options
        return orjson.dumps(ev), None, reason, ["request", "questions", qid, "criteria"]
    if kind in ("many_score", "few_score"):
        n = draw(st.integers(11, 40) if kind == "many_score" else st.integers(0, 1))
        qs[qid] = {"type": "score", "criteria": [f"level {i}" for i in range(n)]}
        reason = R.too_many_options if kind == "many_score" else R.too_few_options
        return orjson.dumps(ev), None, reason, ["request", "questions", qid, "criteria"]
    if kind == "state_str":
        limit = draw(st.integers(1, 50))
        ev["request"]["state"] = draw(st.text(min_size=limit + 1, max_size=limit + 20))
        return orjson.dumps(ev), Limits(max_state_chars=limit), R.oversized_state, ["request", "state"]
    if kind == "state_json":
        items = draw(st.lists(json_ints, min_size=1, max_size=20))
        ev["request"]["state"] = {"items": items}
        rendered = len(orjson.dumps({"items": items}).decode())
        limit = draw(st.integers(1, rendered - 1))
        return orjson.dumps(ev), Limits(max_state_chars=limit), R.oversized_state, ["request", "state"]
    if kind == "questions":
        limit = len(qs) - 1 if len(qs) > 1 else 1
        while len(qs) <= limit:
            qs[f"extra-{len(qs)}"] = {"type": "noul"}
        return orjson.dumps(ev), Limits(max_questions=limit), R.too_many_questions, ["request", "questions"]
    if kind == "image":
        good = draw(st.lists(st.just("AAAA"), max_size=3))
        i = len(good)
        bad = draw(
            st.sampled_from(["AAA", "AA!A", "A A=", "data:image/png;base64,", "data:text/html;base64,AAAA"])
        )
        ev["request"]["images"] = good + [bad]
        return orjson.dumps(ev), None, R.invalid_image, ["request", "images", i]
    if kind == "too_many_images":
        ev["request"]["images"] = ["AAAA"] * draw(st.integers(9, 12))
        return orjson.dumps(ev), None, R.invalid_image, ["request", "images"]
    if kind == "dup_question":
        parts = [orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in qs.items()]
        parts.insert(draw(st.integers(0, len(parts))), orjson.dumps(qid) + b':{"type":"noul"}')
        raw = _with_raw_questions(ev, b"{" + b",".join(parts) + b"}")
        return raw, None, R.duplicate_question_ids, ["request", "questions", qid]
    if kind == "dup_envelope":
        field = draw(st.sampled_from(["tenant", "source", "event_id"]))
        raw = orjson.dumps(ev)
        raw = raw[:-1] + b"," + orjson.dumps(field) + b":" + orjson.dumps(ev[field]) + b"}"
        return raw, None, R.duplicate_keys, [field]
    if kind == "utf8":
        raw = orjson.dumps(ev)
        cut = raw.index(b'"event_id":"') + len(b'"event_id":"')
        bad = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
        return raw[:cut] + bad + raw[cut:], None, R.invalid_utf8, []
    if kind == "json":
        text = orjson.dumps(ev).decode()
        cut = draw(st.integers(0, len(text) - 1))  # every proper prefix of an object is unfinished
        return text[:cut].encode(), None, R.invalid_json, []
    if kind == "payload":
        raw = orjson.dumps(ev)
        return raw, Limits(max_payload_bytes=len(raw) - 1), R.oversized_payload, []
    if kind == "missing":
        field = draw(st.sampled_from(["event_id", "source", "tenant", "created_at", "request"]))
        del ev[field]
        return orjson.dumps(ev), None, R.schema_violation, [field]
    if kind == "extra":
        name = draw(nonblank.filter(lambda k: k not in EvidenceEvent.model_fields))
        ev[name] = 1
        return orjson.dumps(ev), None, R.schema_violation, [name]
    assert kind == "seed_type"
    ev["seed"] = draw(st.sampled_from(["1", 1.5, True, -1, 2**63, None]))
    if ev["seed"] is None:
        ev["seed"] = [1]
    return orjson.dumps(ev), None, R.schema_violation, ["seed"]


@settings(max_examples=400, deadline=None)
@given(mutations())
def test_mutation_gives_reason_and_loc(
    case: tuple[bytes, Limits | None, ReasonCode, list[str | int]],
) -> None:
    raw, limits, reason, loc = case
    err = _reject(raw, limits)
    assert err.reason is reason, (err.reason, err.message)
    assert loc in _locs(err), (loc, _locs(err))
    assert err.message  # human-readable, names the field
    if loc:
        assert ".".join(map(str, loc)) in err.message


# ---- hand-written: one case per reason code ----------------------------------------------------------

BASE: dict[str, Any] = {
    "event_id": "evt-1",
    "source": "ticket",
    "tenant": "acme",
    "created_at": "2026-11-29T10:00:00+01:00",
    "request": {
        "state": {"subject": "Login broken", "body": "I cannot log in since: yesterday"},
        "questions": {
            "urgent": {"type": "noul", "instructions": "Is this urgent?"},
            "team": {"type": "choice", "criteria": {"auth": "Login and accounts", "billing": None}},
            "severity": {"type": "score", "criteria": ["cosmetic", "minor", "major"]},
        },
    },
}


def _event(**changes: Any) -> dict[str, Any]:
    ev = copy.deepcopy(BASE)
    for path, value in changes.items():
        *parents, last = path.split("__")
        node = ev
        for p in parents:
            node = node[p]
        node[last] = value
    return ev


def test_base_event_is_valid() -> None:
    ev = parse_event(orjson.dumps(BASE))
    assert list(ev.request.questions) == ["urgent", "team", "severity"]
    assert ev.created_at.utcoffset().total_seconds() == 3600
    assert classify_invalid(orjson.dumps(BASE)) is None


def test_invalid_utf8() -> None:
    e = _reject(orjson.dumps(BASE).replace(b"acme", b"ac\xc3\x28e"))
    assert e.reason is R.invalid_utf8 and "byte" in e.message


def test_invalid_json() -> None:
    assert _reject(b'{"event_id": "x",}').reason is R.invalid_json
    assert _reject(b"").reason is R.invalid_json
    assert _reject(orjson.dumps(BASE).replace(b'"tenant"', b"'tenant'")).reason is R.invalid_json
    assert _reject(b'{"a": NaN}').reason is R.invalid_json  # NaN is not JSON


def test_duplicate_keys_anywhere() -> None:
    raw = orjson.dumps(BASE).replace(b'"subject":"Login broken"', b'"subject":"a","subject":"b"')
    e = _reject(raw)
    assert e.reason is R.duplicate_keys and e.errors[0].loc == ["request", "state", "subject"]
    # A repeated key hidden behind an escape (\u0061 is "a") is still a repeat.
    e = _reject(b'{"event_id":"x","request":{"state":{"a":1,"\\u0061":2}}}')
    assert e.reason is R.duplicate_keys and e.errors[0].loc == ["request", "state", "a"]


def test_escaped_colons_do_not_fool_the_duplicate_check() -> None:
    # \u003a decodes to ':'; a naive colon count would see extra separators here.
    ok = orjson.dumps(BASE).replace(b"since: yesterday", b"since\\u003a\\u003a yesterday")
    assert parse_event(ok).request.state["body"] == "I cannot log in since:: yesterday"
    dup = ok.replace(b'"subject":"Login broken"', b'"subject":"x\\u003a","subject":"y"')
    assert _reject(dup).reason is R.duplicate_keys


def test_duplicate_question_ids() -> None:
    raw = orjson.dumps(BASE).replace(b'"team":{', b'"urgent":{"type":"noul"},"team":{')
    e = _reject(raw)
    assert e.reason is R.duplicate_question_ids
    assert e.errors[0].loc == ["request", "questions", "urgent"]


def test_schema_violation_points_at_field() -> None:
    e = _reject(orjson.dumps(_event(request__questions__team__criteria={"auth": 3, "billing": None})))
    assert e.reason is R.schema_violation and e.errors[0].loc == ["request", "questions", "team", "criteria"]
    e = _reject(orjson.dumps(_event(created_at="2026-11-29T10:00:00")))  # naive time
    assert e.reason is R.schema_violation and e.errors[0].loc == ["created_at"]
    e = _reject(orjson.dumps(_event(gate=1.01)))
    assert e.reason is R.schema_violation and e.errors[0].loc == ["gate"]
    e = _reject(orjson.dumps(_event(request__questions__urgent__criteria={"true": "yes", "maybe": None})))
    assert e.reason is R.schema_violation and e.errors[0].loc == [
        "request",
        "questions",
        "urgent",
        "criteria",
    ]
    e = _reject(orjson.dumps(_event(request__questions__team__criteria={"auth": None, "  ": None})))
    assert e.reason is R.schema_violation and "non-empty" in e.message
    e = _reject(orjson.dumps([BASE]))
    assert e.reason is R.schema_violation
    e = _reject(orjson.dumps(_event(request__questions={})))
    assert e.reason is R.schema_violation and e.errors[0].loc == ["request", "questions"]
    e = _reject(orjson.dumps(_event(event_id="a\tb")))
    assert e.reason is R.schema_violation and e.errors[0].loc == ["event_id"]
    e = _reject(orjson.dumps(_event(thought_budget=0)))
    assert e.reason is R.schema_violation and e.errors[0].loc == ["thought_budget"]


def test_too_many_and_too_few_options() -> None:
    crit = {f"o{i}": None for i in range(256)}
    e = _reject(orjson.dumps(_event(request__questions__team__criteria=crit)))
    assert e.reason is R.too_many_options and "256" in e.message
    crit.pop("o255")  # 255 is the maximum
    assert (
        len(parse_event(orjson.dumps(_event(request__questions__team__criteria=crit))).request.questions) == 3
    )
    e = _reject(orjson.dumps(_event(request__questions__severity__criteria=["x"] * 11)))
    assert e.reason is R.too_many_options
    e = _reject(orjson.dumps(_event(request__questions__severity__criteria=["only"])))
    assert e.reason is R.too_few_options
    e = _reject(orjson.dumps(_event(request__questions__team__criteria={"solo": None})))
    assert e.reason is R.too_few_options
    e = _reject(orjson.dumps(_event(request__questions__team__criteria=None)))  # choice needs criteria
    assert e.reason is R.schema_violation


def test_oversized_state_counts_compact_json() -> None:
    state = {"k": "é" * 10}
    rendered = orjson.dumps(state).decode()  # '{"k":"éééééééééé"}' -> 18 characters
    assert len(rendered) == 18
    ok = orjson.dumps(_event(request__state=state))
    assert parse_event(ok, Limits(max_state_chars=18)).request.state == state
    e = _reject(ok, Limits(max_state_chars=17))
    assert e.reason is R.oversized_state and e.errors[0].loc == ["request", "state"]
    e = _reject(orjson.dumps(_event(request__state="x" * 1_000_001)))  # the default limit
    assert e.reason is R.oversized_state


def test_oversized_payload() -> None:
    raw = orjson.dumps(BASE)
    assert parse_event(raw, Limits(max_payload_bytes=len(raw)))
    e = _reject(raw, Limits(max_payload_bytes=len(raw) - 1))
    assert e.reason is R.oversized_payload and str(len(raw)) in e.message
    # The size check comes first: even bytes that are not UTF-8 are refused for their size.
    assert _reject(b"\xff" * 100, Limits(max_payload_bytes=99)).reason is R.oversized_payload


def test_unknown_question_type() -> None:
    e = _reject(orjson.dumps(_event(request__questions__team__type="ranking")))
    assert e.reason is R.unknown_question_type
    assert e.errors[0].loc == ["request", "questions", "team", "type"]
    assert "ranking" in e.message


def test_too_many_questions() -> None:
    qs = {f"q{i}": {"type": "noul"} for i in range(65)}
    e = _reject(orjson.dumps(_event(request__questions=qs)))
    assert e.reason is R.too_many_questions and "65" in e.message
    qs.pop("q64")
    assert len(parse_event(orjson.dumps(_event(request__questions=qs))).request.questions) == 64
    assert _reject(orjson.dumps(BASE), Limits(max_questions=2)).reason is R.too_many_questions


def test_invalid_image() -> None:
    for bad in ["not base64!", "QUJD\n", "data:image/png,QUJD", "data:application/pdf;base64,QUJD", ""]:
        e = _reject(orjson.dumps(_event(request__images=["QUJD", bad])))
        assert e.reason is R.invalid_image, bad
        assert e.errors[0].loc == ["request", "images", 1]
    big = "A" * (4 * 1024)  # decodes to 3072 bytes
    assert parse_event(orjson.dumps(_event(request__images=[big])), Limits(max_image_bytes=3072))
    e = _reject(orjson.dumps(_event(request__images=[big])), Limits(max_image_bytes=3071))
    assert e.reason is R.invalid_image and "3072" in e.message


def test_engine_rejected_is_a_reason_for_the_pipeline() -> None:
    # Not produced by parse_event (the engine decides it later) but a valid dead-letter reason.
    assert R("engine_rejected") is R.engine_rejected


def test_priority_when_several_errors() -> None:
    # A specific reason wins over generic schema errors whatever the order pydantic reports them in.
    ev = _event(seed="x", request__questions__team__type="ranking")
    e = _reject(orjson.dumps(ev))
    assert e.reason is R.unknown_question_type
    assert {tuple(loc) for loc in _locs(e)} == {("seed",), ("request", "questions", "team", "type")}
    assert "and 1 more error" in e.message


def test_deep_nesting_is_refused_cleanly() -> None:
    marker = orjson.dumps("\u2603deep\u2603")
    raw = orjson.dumps(_event(request__state="\u2603deep\u2603")).replace(
        marker, b"[" * 300 + b"1" + b"]" * 300
    )
    e = _reject(raw)
    assert e.reason is R.schema_violation and "depth" in e.message and len(e.message) < 300
    assert _reject(b"[" * 2000 + b"]" * 2000).reason is R.invalid_json  # beyond orjson's nesting limit
    # A repeated key deeper than the stdlib parser can walk is still reported as a repeat.
    raw = b'{"a":' + b"[" * 990 + b'{"x":1,"x":2}' + b"]" * 990 + b"}"
    assert _reject(raw).reason is R.duplicate_keys


_json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**60), 2**60), st.text(alphabet=':a"\\é\n', max_size=6)
)
_json_tree = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(st.tuples(st.text(alphabet=":ab", max_size=3), inner), max_size=4)
    ),
    max_leaves=12,
)


def _write(node: object, escape: bool) -> str:
    """JSON text of a tree whose objects are (key, value) pair lists, so keys may repeat; with
    `escape`, every ':' inside a string written as the escape \\u003a."""
    if isinstance(node, list) and node and all(isinstance(x, tuple) for x in node):
        return "{" + ",".join(f"{_write(k, escape)}:{_write(v, escape)}" for k, v in node) + "}"
    if isinstance(node, list):
        return "[" + ",".join(_write(x, escape) for x in node) + "]"
    text = json.dumps(node, ensure_ascii=False)
    return text.replace(":", "\\u003a") if escape and isinstance(node, str) else text


def _repeats(text: str) -> bool:
    """The oracle: the stdlib parser's pair lists, checked object by object."""
    found = False

    def hook(pairs: list[tuple[str, object]]) -> dict:
        nonlocal found
        found = found or len({k for k, _ in pairs}) != len(pairs)
        return dict(pairs)

    json.loads(text, object_pairs_hook=hook)
    return found


@settings(max_examples=300, deadline=None)
@given(_json_tree, st.booleans())
def test_the_duplicate_count_agrees_with_the_stdlib_parser(tree: object, escape: bool) -> None:
    text = _write(tree, escape)  # escaped colons take the count's other (regex) path
    raw = text.encode()
    assert has_duplicate_keys(raw, orjson.loads(raw)) == _repeats(text)


def test_the_duplicate_count_holds_past_orjsons_writing_depth() -> None:
    # orjson reads ~1,000 levels but writes 254: the count falls back to walking the tree
    deep = "[" * 300 + '{"a":1,"a":2}' + "]" * 300
    assert has_duplicate_keys(deep.encode(), orjson.loads(deep)) and _repeats(deep)
    distinct = deep.replace('"a":2', '"b":2')
    assert not has_duplicate_keys(distinct.encode(), orjson.loads(distinct)) and not _repeats(distinct)
