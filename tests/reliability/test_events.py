"""The load tools' inputs against the contract's own parser (`schemas.parse_event`) as the oracle."""

from __future__ import annotations

import pytest

from ops.load.events import EventMix, control_event, hostile_cases, sample_events
from ops.load.generate import LoadError, require_loopback
from schemas.deadletter import InvalidEvent, parse_event


def outcome(raw: bytes) -> tuple[str, str | None]:
    try:
        parse_event(raw)
    except InvalidEvent as e:
        return "dead_letter", str(e.reason)
    return "record", None


def test_event_mix_expectations_match_the_parser_and_ids_are_fresh() -> None:
    mix = EventMix("t", poison_fraction=0.3, seed=7)
    msgs = [mix.message(i) for i in range(300)]
    poison = [m for m in msgs if m.kind == "poison"]
    assert 0.2 < len(poison) / len(msgs) < 0.4  # the seeded share, roughly 30 %
    for m in msgs:
        kind, reason = outcome(m.value)
        assert kind == m.expect, m.label
        if m.expect == "dead_letter":
            assert reason == m.reason, m.label
    assert len({m.key for m in msgs}) == len(msgs)
    samples = {s["event_id"] for s in sample_events()}
    assert not samples & {m.key.decode() for m in msgs}
    assert {m.label for m in msgs if m.kind == "event"} <= {f"sample:{s}" for s in samples}
    assert EventMix("t", 0.3, 7).message(42) == msgs[42]  # reproducible


def test_hostile_cases_get_the_outcome_the_contract_defines() -> None:
    cases = hostile_cases("h")
    assert len({m.key for m in cases}) == len(cases)
    for m in cases:
        kind, reason = outcome(m.value)
        if m.reason == "engine_rejected":  # valid by the contract; the text-only engine refuses it
            assert kind == "record", m.label
            continue
        assert (kind, reason) == (m.expect, m.reason), m.label
    sizes = {m.label: len(m.value) for m in cases}
    assert sizes["payload_10mb"] >= 10_000_000
    assert outcome(control_event("c")) == ("record", None)


@pytest.mark.parametrize("bootstrap", ["10.0.0.1:9092", "example.com:9092", "127.0.0.1:1,8.8.8.8:9092", ""])
def test_load_tools_refuse_non_loopback_brokers(bootstrap: str) -> None:
    with pytest.raises(LoadError):
        require_loopback(bootstrap)


def test_loopback_brokers_are_accepted() -> None:
    assert require_loopback("127.0.0.1:9092,localhost:1,[::1]:2") == [
        "127.0.0.1:9092",
        "localhost:1",
        "[::1]:2",
    ]


def test_event_mix_samples_a_given_file(tmp_path) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_bytes(control_event("mine") + b"\n")
    mix = EventMix("f", samples=path)
    msgs = [mix.message(i) for i in range(5)]
    assert {m.label for m in msgs} == {"sample:mine"}
    assert all(outcome(m.value) == ("record", None) for m in msgs)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="one JSON event object per line"):
        EventMix("f", samples=path)
