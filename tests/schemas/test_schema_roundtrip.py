"""dumps -> loads round trips: equal models, byte-identical re-encoding, bit-exact floats."""

from __future__ import annotations

import base64
import math
import struct

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schema_strategies import event_dicts, events, finite_floats, json_values, records

from schemas import (
    DeadLetter,
    DecisionRecord,
    EvidenceEvent,
    ReasonCode,
    RoundReadout,
    SystemOneRequest,
    dead_letter,
    dumps,
    loads,
    parse_event,
)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


@settings(max_examples=150, deadline=None)
@given(events)
def test_event_round_trip(event: EvidenceEvent) -> None:
    raw = dumps(event)
    back = loads(raw, EvidenceEvent)
    assert back == event
    assert dumps(back) == raw
    # The pipeline's strict entry point agrees with the plain decoder on everything dumps writes.
    assert parse_event(raw) == event


@settings(max_examples=100, deadline=None)
@given(event_dicts())
def test_producer_json_parses_to_same_content(ev: dict) -> None:
    # What a producer sends (orjson of a plain dict) is read back with every value intact.
    event = parse_event(orjson.dumps(ev))
    assert event.event_id == ev["event_id"]
    assert event.request.state == ev["request"]["state"]
    assert list(event.request.questions) == list(ev["request"]["questions"])
    for qid, q in ev["request"]["questions"].items():
        assert event.request.questions[qid].criteria == q.get("criteria")
        # Option order is semantic (display order) and must survive decoding.
        if isinstance(q.get("criteria"), dict):
            assert list(event.request.questions[qid].criteria) == list(q["criteria"])


@settings(max_examples=100, deadline=None)
@given(records)
def test_record_round_trip(record: DecisionRecord) -> None:
    raw = dumps(record)
    back = loads(raw, DecisionRecord)
    assert back == record
    assert dumps(back) == raw
    # No whitespace between tokens: the compact form is the canonical value.
    assert raw == orjson.dumps(orjson.loads(raw))


@settings(max_examples=300, deadline=None)
@given(st.lists(finite_floats, min_size=1, max_size=8))
def test_floats_round_trip_bit_exact(logits: list[float]) -> None:
    letters = [chr(65 + i) for i in range(len(logits))]
    r = RoundReadout(
        options=[f"o{i}" for i in range(len(logits))], letters=letters, logits=logits, coverage=0.5
    )
    back = loads(dumps(r), RoundReadout)
    assert [_bits(x) for x in back.logits] == [_bits(x) for x in logits]


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_json_state_round_trip_bit_exact(state: object) -> None:
    req = SystemOneRequest(state=state, questions={"q": {"type": "noul"}})
    back = loads(dumps(req), SystemOneRequest)

    def same(a: object, b: object) -> bool:
        if isinstance(a, float):
            return isinstance(b, float) and _bits(a) == _bits(b)
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
        if isinstance(a, dict):
            return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        return type(a) is type(b) and a == b

    assert same(back.state, state)


@pytest.mark.parametrize(
    "x",
    [
        0.0,
        -0.0,
        5e-324,
        -5e-324,
        2.2250738585072014e-308,
        1.7976931348623157e308,
        0.1 + 0.2,
        1 / 3,
        1e16,
        2.0**53 + 2,
    ],
)
def test_float_edge_cases_bit_exact(x: float) -> None:
    r = RoundReadout(options=["a"], letters=["A"], logits=[x], coverage=0.0)
    back = loads(dumps(r), RoundReadout)
    assert _bits(back.logits[0]) == _bits(x)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_rejected_not_encoded(bad: float) -> None:
    # orjson would silently write NaN as null; validation must stop it first.
    with pytest.raises(ValueError, match="finite"):
        RoundReadout(options=["a"], letters=["A"], logits=[bad], coverage=0.0)
    with pytest.raises(ValueError, match="finite"):
        SystemOneRequest(state={"x": [1.0, bad]}, questions={"q": {"type": "noul"}})


def test_dead_letter_round_trip_keeps_original_bytes() -> None:
    raw = b'{"event_id": "e", \xff}'
    dl = dead_letter(
        raw, ReasonCode.invalid_utf8, "bad", topic="events", partition=3, offset=41, key=b"k\x00"
    )
    back = loads(dumps(dl), DeadLetter)
    assert back == dl
    assert base64.b64decode(back.original_b64) == raw
    assert base64.b64decode(back.key_b64 or "") == b"k\x00"
    assert back.original_size == len(raw)
