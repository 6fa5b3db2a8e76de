"""`prism replay`: re-decide recorded events and compare the decision records bit for bit.

A decision record is a pure function of (event, model file digest, precision path, decision
config, seed), so re-deciding an input event with the model and config its record names must give
the same bytes. Replay:

1. reads the decisions topic (every record carries `input: {topic, partition, offset}`, the input
   event it decided; run metadata such as the engine batch is in its headers);
2. selects input events by topic + partition/offset range, by time range (`offsets_for_times`),
   or by event id (looked up through the records' `input`; with a topic, only those events, each
   of which must be in the topic's range, else replay stops naming it);
3. refuses, naming the difference, when the given model file's digest, the precision path or the
   decision config digest differ from what the records name (comparing under another model is
   meaningless, not a finding);
4. re-decides the events and compares the canonical record bytes; a difference is reported field
   by field (path -> recorded vs replayed, floats also as `float.hex()`).

The int8 path is batch invariant, so any grouping reproduces a record; the fp32/bf16 reference
paths are not (their float reductions follow the batch's shape), so events are re-decided in the
batches the worker's `prism-batch`/`prism-batch-pos` headers name, together with batch-mates
outside the selection (decided, not reported).

Every copy of a record on the topic is checked (a redelivered event has several; they must all
be byte-identical). Inputs that are not valid events, and events the engine rejects again, have no
record by design (the worker dead-lettered them) and are counted, not failed.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import structlog

from prism_pipeline.core.batching import recorded_batches
from prism_pipeline.core.decide import DecisionRules, Origin, Prepared, decide_batch, prepare, settle
from prism_pipeline.core.records import DecisionEngine, provenance, run_headers
from prism_pipeline.core.seeds import SeedPolicy
from prism_pipeline.offline.engines import EngineSource
from prism_pipeline.offline.errors import ReplayError
from prism_pipeline.offline.kafka_range import Position, fetch_positions, range_consumer
from prism_pipeline.offline.record_diff import FieldDiff, record_diff
from prism_pipeline.offline.recorded import RecordIndex, read_records
from prism_pipeline.offline.selection import Selection, in_bounds, range_bounds, range_positions, scan_for_ids
from schemas.codec import dumps
from schemas.deadletter import InvalidEvent, classify_invalid, parse_event
from schemas.event import EvidenceEvent
from schemas.record import DecisionRecord, InputRef, record_key
from schemas.systemone import Limits

log = structlog.get_logger(__name__)

Status = Literal["identical", "different", "missing", "invalid", "rejected"]
VERSION_FIELDS = ("engine_version", "render_version")  # provenance fields a replay may differ in


# ---- the replay ------------------------------------------------------------------------------------


@dataclass
class EventOutcome:
    position: Position
    event_id: str | None
    status: Status
    diffs: list[FieldDiff] = field(default_factory=list)
    note: str = ""
    copies: int = 0  # record copies found on the decisions topic
    replayed: bytes | None = None
    # (field, recorded, replayed) for each of VERSION_FIELDS the record names differently from
    # this replay's engine: its differences are then expected and summarized, not listed
    version_change: tuple[tuple[str, str, str], ...] = ()

    @property
    def changed_answers(self) -> list[str]:
        """The question ids whose answer differs (from the field paths `answers.<qid>...`)."""
        qids = (d.path.split(".", 2)[1].split("[", 1)[0] for d in self.diffs if d.path.startswith("answers."))
        return list(dict.fromkeys(qids))

    @property
    def only_versions_differ(self) -> bool:
        """Every difference is a version field: the record reproduces but for the versions it names."""
        names = {f"model.{f}" for f, _, _ in self.version_change}
        return bool(self.diffs) and all(d.path in names for d in self.diffs)


@dataclass
class ReplayReport:
    outcomes: list[EventOutcome]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    explain: str | None = None
    published: int = 0

    def count(self, status: Status) -> int:
        return sum(1 for o in self.outcomes if o.status == status)

    @property
    def checked(self) -> int:
        return self.count("identical") + self.count("different")

    @property
    def ok(self) -> bool:
        return self.count("different") == 0 and self.count("missing") == 0


@dataclass(frozen=True)
class ReplayOptions:
    seed_policy: SeedPolicy = "event"
    fixed_seed: int = 0
    limits: Limits | None = None
    max_batch_events: int = 64  # int8 (batch invariant) events are regrouped freely, this many a call
    max_gate: float | None = None  # as the worker's --max-gate (records do not name it)

    def rules(self) -> DecisionRules:
        return DecisionRules(self.limits, self.seed_policy, self.fixed_seed, self.max_gate)


def pos_text(p: Position) -> str:
    return f"{p[0]}/{p[1]}@{p[2]}"


def replay_events(
    selected: list[Position],
    inputs: dict[Position, bytes],
    index: RecordIndex,
    engines: EngineSource,
    options: ReplayOptions = ReplayOptions(),
) -> tuple[list[EventOutcome], dict[Position, tuple[EvidenceEvent, bytes]]]:
    """Re-decide `selected` (plus the batch-mates they need) and compare with the recorded copies.

    Returns the outcomes in selection order and, per decided position, (event, replayed bytes).
    Raises ReplayRefused before deciding anything if a needed model/config is not available.
    """

    def model_of(pos: Position) -> dict[str, Any] | None:
        copies = index.by_input.get(pos)
        return copies[0].model if copies else None

    def precision_of(pos: Position) -> str | None:
        m = model_of(pos)
        return str(m.get("precision")) if m else None

    def label_of(pos: Position) -> str | None:
        copies = index.by_input.get(pos)
        return copies[0].batch if copies else None

    groups = recorded_batches(
        selected,
        label_of,
        lambda batch: [p for _, p in sorted(index.by_batch[batch])],
        lambda pos: precision_of(pos) == "int8",
        options.max_batch_events,
    )
    # Resolve every engine first: a refusal must come before any work, and name the record.
    engine_of: dict[Position, DecisionEngine] = {}
    for group in groups:
        for pos in group:
            if pos in index.by_input:
                copy = index.by_input[pos][0]
                engine_of[pos] = engines.engine_for(
                    copy.model, f"record {copy.event_id!r} (input {pos_text(pos)})"
                )
    default_engine = next(iter(engine_of.values()), None)

    decided: dict[Position, tuple[EvidenceEvent, bytes | str]] = {}
    invalid: dict[Position, InvalidEvent] = {}
    rules = options.rules()
    for group in groups:
        # One engine per call; records of one batch share it (split defensively if not).
        by_engine: dict[int, list[tuple[Position, Prepared]]] = defaultdict(list)
        engines_by_id: dict[int, DecisionEngine] = {}
        for pos in group:
            raw = inputs.get(pos)
            eng = engine_of.get(pos, default_engine)
            if raw is None:
                continue  # reported as missing
            if eng is None:  # no record names a model to decide it with: missing, unless invalid
                bad = classify_invalid(raw, rules.limits)
                if bad is not None:
                    invalid[pos] = bad
                continue
            prep = prepare(raw, eng, rules)
            if isinstance(prep, InvalidEvent):
                if classify_invalid(raw, rules.limits) is not None:
                    invalid[pos] = prep  # not a valid event
                else:  # a valid event the engine refuses before deciding (an image, its depth)
                    refused = f"engine rejected the event: {prep.reason}: {prep.message}"
                    decided[pos] = (parse_event(raw, rules.limits), refused)
                continue
            by_engine[id(eng)].append((pos, prep))
            engines_by_id[id(eng)] = eng
        for key, members in by_engine.items():
            eng = engines_by_id[key]
            model = provenance(eng)
            decided_now = decide_batch(eng.decide, [prep.request for _, prep in members])
            for (pos, prep), res in zip(members, decided_now.results, strict=True):
                source = InputRef(topic=pos[0], partition=pos[1], offset=pos[2])
                done = settle(inputs[pos], prep, res, model, Origin(*pos), source=source)
                again = dumps(done) if isinstance(done, DecisionRecord) else done.message
                decided[pos] = (prep.event, again)

    outcomes: list[EventOutcome] = []
    for pos in selected:
        copies = index.by_input.get(pos, [])
        eid = copies[0].event_id if copies else None
        if pos in invalid:
            status: Status = "different" if copies else "invalid"
            note = f"input is not a valid event ({invalid[pos].message})"
            outcomes.append(EventOutcome(pos, eid, status, note=note, copies=len(copies)))
            continue
        if pos not in decided:
            note = "input message not found" if pos not in inputs else "no record and no model to decide it"
            outcomes.append(EventOutcome(pos, eid, "missing", note=note, copies=len(copies)))
            continue
        ev, again = decided[pos]
        eid = ev.event_id
        if isinstance(again, str):  # the engine refused it again
            status = "different" if copies else "rejected"
            outcomes.append(EventOutcome(pos, eid, status, note=again, copies=len(copies)))
            continue
        if not copies:
            outcomes.append(EventOutcome(pos, eid, "missing", note="no decision record", replayed=again))
            continue
        diffs: list[FieldDiff] = []
        notes = []
        for c in {c.value: c for c in copies}.values():
            d = record_diff(c.value, again)
            if d:
                notes.append(f"copy at decisions {c.where[0]}@{c.where[1]}")
                diffs.extend(d)
        status = "different" if diffs else "identical"
        eng = engine_of.get(pos, default_engine)
        recorded_model = copies[0].model or {}
        changes = tuple(
            (f, str(recorded_model.get(f)), str(getattr(eng, f)))
            for f in VERSION_FIELDS
            if eng is not None and recorded_model.get(f) != getattr(eng, f)
        )
        outcomes.append(
            EventOutcome(
                pos, eid, status, diffs, "; ".join(notes), copies=len(copies), replayed=again,
                version_change=changes,
            )
        )  # fmt: skip
    events = {pos: (ev, v) for pos, (ev, v) in decided.items() if isinstance(v, bytes)}
    return outcomes, events


async def _select(
    bootstrap: str, consumer: Any, selection: Selection, index: RecordIndex, explain_event: str | None
) -> tuple[list[Position], list[str]]:
    """The input positions to replay, and the asked-for event ids no record names.

    A topic (and range) alone selects the range. Event ids with a topic select those events alone,
    and only within the topic and range: one that is not there raises ReplayError naming it (the
    range is read for ids without a record before saying so). Event ids without a topic are looked
    up through the records; those without one come back as missing. The event to --explain is
    always added (found through its record)."""
    ids = list(dict.fromkeys(selection.event_ids))
    selected: list[Position] = []
    missing_ids: list[str] = []
    if selection.topic is not None and not ids:
        selected = await range_positions(bootstrap, consumer, selection)
    elif selection.topic is not None:
        topic = selection.topic
        bounds = await range_bounds(bootstrap, consumer, selection)
        found = {e: [p for p in index.by_event.get(e, ()) if in_bounds(p, topic, bounds)] for e in ids}
        unrecorded = {e for e, where in found.items() if not where}
        if unrecorded:
            found.update(await scan_for_ids(bootstrap, topic, bounds, unrecorded))
        absent = [e for e in ids if not found.get(e)]
        if absent:
            raise ReplayError(_absent_text(absent, topic, selection, index))
        selected = [p for e in ids for p in found[e]]
    else:
        for eid in ids:
            where = index.by_event.get(eid)
            if not where:
                missing_ids.append(eid)
            selected.extend(where or ())
    if explain_event is not None:
        selected.extend(index.by_event.get(explain_event, ()))
        if not index.by_event.get(explain_event) and explain_event not in ids:
            missing_ids.append(explain_event)
    return list(dict.fromkeys(selected)), missing_ids


def _absent_text(absent: list[str], topic: str, selection: Selection, index: RecordIndex) -> str:
    where = f"the selected range of topic {topic!r}" if selection.ranged else f"topic {topic!r}"
    parts = []
    for eid in absent:
        elsewhere = index.by_event.get(eid)
        parts.append(
            f"{eid!r} (its record names input {', '.join(pos_text(p) for p in elsewhere)})"
            if elsewhere
            else repr(eid)
        )
    return f"event id(s) not in {where}: {', '.join(parts)}"


async def _publish(bootstrap: str, topic: str, outcomes: list[EventOutcome], replay_id: str) -> int:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    n = 0
    try:
        for o in outcomes:
            if o.replayed is None or o.event_id is None:
                continue
            headers = [*run_headers(replay_id, 1), ("prism-replay-of", pos_text(o.position).encode())]
            await producer.send(topic, o.replayed, key=record_key(o.event_id), headers=headers)
            n += 1
        await producer.flush()
    finally:
        await producer.stop()
    return n


async def replay(
    bootstrap: str,
    records_topic: str,
    selection: Selection,
    engines: EngineSource,
    options: ReplayOptions = ReplayOptions(),
    *,
    publish: str | None = None,
    explain_event: str | None = None,
    replay_id: str = "replay",
) -> ReplayReport:
    """Replay the selected input events against the records on `records_topic` (see module doc)."""
    from prism_pipeline.offline.explain import explain

    selection.check()
    t0 = time.monotonic()
    index = await read_records(bootstrap, records_topic)
    notes: list[str] = []
    if index.unreadable:
        notes.append(
            f"{index.unreadable} message(s) on {records_topic} are not records with an input position"
        )
    consumer = range_consumer(bootstrap)
    await consumer.start()
    try:
        selected, missing_ids = await _select(bootstrap, consumer, selection, index, explain_event)
        needed = set(selected)
        for pos in selected:  # batch-mates of reference-path records
            copies = index.by_input.get(pos)
            if copies and copies[0].batch is not None and (copies[0].model or {}).get("precision") != "int8":
                needed.update(p for _, p in index.by_batch[copies[0].batch])
        inputs = await fetch_positions(consumer, needed) if needed else {}
    finally:
        await consumer.stop()
    log.info("replay.selected", events=len(selected), decided=len(needed), records=len(index.by_input))
    outcomes, decided = await asyncio.to_thread(replay_events, selected, inputs, index, engines, options)
    for eid in missing_ids:
        outcomes.append(
            EventOutcome(("", 0, 0), eid, "missing", note=f"no record for event id on {records_topic}")
        )
    notes.extend(engines.notes)
    report = ReplayReport(outcomes, notes, time.monotonic() - t0)
    if explain_event is not None:
        hits = [(p, decided[p]) for p in index.by_event.get(explain_event, []) if p in decided]
        if hits:
            pos, (ev, value) = hits[-1]
            outcome = next(o for o in outcomes if o.position == pos)
            verdict = f"replay: {outcome.status} to the recorded decision ({outcome.copies} recorded copies)"
            report.explain = explain(ev, DecisionRecord.model_validate(orjson.loads(value)), verdict)
        else:
            report.explain = f"cannot explain {explain_event!r}: no decision record names it\n"
    if publish is not None:
        report.published = await _publish(bootstrap, publish, outcomes, replay_id)
    return report
