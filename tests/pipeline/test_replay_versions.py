"""Replaying records of an older engine version: the version change is reported as such, with what
the records still reproduce, instead of a wall of moved floats (no broker: the records index is
filled by hand with what the worker would have published)."""

from __future__ import annotations

import math

import orjson

from engine.engine import ENGINE_VERSION
from prism_pipeline.core.records import build_record, decide_request, provenance
from prism_pipeline.offline.engines import EngineSource
from prism_pipeline.offline.recorded import RecordIndex
from prism_pipeline.offline.replay import ReplayReport, replay_events
from prism_pipeline.offline.report import render_report
from schemas.codec import dumps
from schemas.deadletter import parse_event
from schemas.record import InputRef
from tests.pipeline.kafkautil import encode, event

OLD = "0.2.0"


def _recorded(engine, n: int) -> tuple[dict, list[dict]]:
    """n events (the last thinks) and the records this engine gives them, as JSON objects."""
    events = [event(i, prefix="ver", **({"gate": 1.0} if i == n - 1 else {})) for i in range(n)]
    inputs = {("in", 0, i): encode(e) for i, e in enumerate(events)}
    records = []
    for i, raw in enumerate(inputs.values()):
        ev = parse_event(raw)
        req = decide_request(ev)
        (res,) = engine.decide([req])
        rec = build_record(ev, req, res, provenance(engine), InputRef(topic="in", partition=0, offset=i))
        records.append(orjson.loads(dumps(rec)))
    return inputs, records


def _replay(engine, inputs: dict, records: list[dict]) -> ReplayReport:
    index = RecordIndex()
    for i, rec in enumerate(records):
        index.add(orjson.dumps(rec), [], (0, i))
    engines = EngineSource(engines=[engine])
    outcomes, _ = replay_events(list(inputs), inputs, index, engines)
    return ReplayReport(outcomes, engines.notes)


def test_records_of_an_older_engine_are_summarized_not_listed(tiny_engine) -> None:
    assert ENGINE_VERSION != OLD
    inputs, records = _recorded(tiny_engine, 3)
    # record 1: an older engine that decided the same bits; record 2: one whose answer moved
    for rec in records[1:]:
        rec["model"]["engine_version"] = OLD
    moved = records[2]
    moved["answers"]["act"]["noul"] = math.nextafter(moved["answers"]["act"]["noul"], 2.0)
    moved["questions"]["act"]["final_probabilities"][0] = 0.123
    report = _replay(tiny_engine, inputs, records)
    same, old_same, old_moved = report.outcomes
    assert [o.status for o in report.outcomes] == ["identical", "different", "different"]
    assert old_same.version_change == (("engine_version", OLD, ENGINE_VERSION),)
    assert old_same.only_versions_differ and old_same.changed_answers == []
    assert not old_moved.only_versions_differ and old_moved.changed_answers == ["act"]
    assert same.version_change == ()
    text = render_report(report)
    assert (
        f"VERSION CHANGE: 2 of 3 checked records were decided under engine_version '{OLD}' "
        f"(this replay: '{ENGINE_VERSION}')" in text
    )
    assert "1 reproduce every field but the version; 0 keep every answer" in text
    assert "1 change an answer" in text and "answers changed: act" in text
    assert "| replayed" not in text, "no field-by-field listing for another version's records"
    last = text.rstrip().splitlines()[-1]
    assert last == "RESULT: DIFFERENCES FOUND, all in records of another engine/render version"
    assert not report.ok  # still a non-zero exit: this engine cannot vouch for those records


def test_a_difference_under_the_same_version_is_still_listed_field_by_field(tiny_engine) -> None:
    inputs, records = _recorded(tiny_engine, 2)
    records[0]["model"]["engine_version"] = OLD
    old = records[1]["questions"]["sev"]["first"]["probabilities"][1]
    records[1]["questions"]["sev"]["first"]["probabilities"][1] = math.nextafter(old, 2.0)
    text = render_report(_replay(tiny_engine, inputs, records))
    assert "VERSION CHANGE: 1 of 2" in text
    assert "questions.sev.first.probabilities[1]: recorded" in text and old.hex() in text
    assert text.rstrip().endswith("RESULT: DIFFERENCES FOUND")
