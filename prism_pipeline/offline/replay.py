"""`prism replay`: re-decide recorded events and compare the decision records bit for bit.

A decision record is a pure function of (event, model file digest, precision path, decision
config, seed), so re-deciding an input event with the model and config its record names must give
the same bytes. Replay:

1. reads the decisions topic (every record carries `input: {topic, partition, offset}`, the input
   event it decided; run metadata such as the engine batch is in its headers);
2. selects input events by topic + partition/offset range, by time range (`offsets_for_times`),
   or by event id (looked up through the records' `input`);
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

import argparse
import asyncio
import dataclasses
import struct
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import orjson
import structlog

from prism_pipeline.core.batching import recorded_batches
from prism_pipeline.core.decide import DecisionRules, Origin, Prepared, decide_batch, prepare, settle
from prism_pipeline.core.records import DecisionEngine, provenance, run_headers
from prism_pipeline.core.seeds import SeedPolicy
from schemas.codec import dumps
from schemas.deadletter import InvalidEvent, classify_invalid
from schemas.event import EvidenceEvent
from schemas.record import DecisionRecord, InputRef, record_key
from schemas.systemone import Limits

log = structlog.get_logger(__name__)

Position = tuple[str, int, int]  # input (topic, partition, offset)
Status = Literal["identical", "different", "missing", "invalid", "rejected"]
_ABSENT = object()
VERSION_FIELDS = ("engine_version", "render_version")  # provenance fields a replay may differ in
_IDLE_TIMEOUT_S = 30.0  # a partition that stops delivering below its end offset for this long


class ReplayError(RuntimeError):
    """Replay cannot run as asked (bad selection, unknown topic...); the message says why."""


class ReplayRefused(ReplayError):
    """The records name a model, precision or decision config this replay does not have."""


# ---- field-level diff ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldDiff:
    path: str  # e.g. "questions.sev.first.probabilities[2]"; "" is the whole record
    recorded: Any
    replayed: Any

    def render(self) -> str:
        return f"{self.path or '<record>'}: recorded {_show(self.recorded)} | replayed {_show(self.replayed)}"


def _show(v: Any) -> str:
    if v is _ABSENT:
        return "<absent>"
    if isinstance(v, float):
        return f"{v!r} ({v.hex()})"
    text = orjson.dumps(v).decode() if not isinstance(v, str) or not v.startswith("<") else v
    return text if len(text) <= 160 else text[:159] + "…"


def _same_leaf(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):  # bit for bit: -0.0 != 0.0 here
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def _walk(path: str, a: Any, b: Any, out: list[FieldDiff]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            _walk(f"{path}.{k}" if path else k, a.get(k, _ABSENT), b.get(k, _ABSENT), out)
        if [k for k in a if k in b] != [k for k in b if k in a]:  # same keys, other order: other bytes
            out.append(FieldDiff(f"{path}<key order>", list(a), list(b)))
        return
    if isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            _walk(f"{path}[{i}]", a[i] if i < len(a) else _ABSENT, b[i] if i < len(b) else _ABSENT, out)
        return
    if not _same_leaf(a, b):
        out.append(FieldDiff(path, a, b))


def record_diff(recorded: bytes, replayed: bytes) -> list[FieldDiff]:
    """Where two record encodings differ (empty: byte-identical)."""
    if recorded == replayed:
        return []
    try:
        a = orjson.loads(recorded)
    except orjson.JSONDecodeError as e:
        return [FieldDiff("", f"<not JSON: {e}>", "<a valid record>")]
    out: list[FieldDiff] = []
    _walk("", a, orjson.loads(replayed), out)
    if not out:  # equal values, different spelling (whitespace, number form): point at the bytes
        n = min(len(recorded), len(replayed))
        i = next((i for i in range(n) if recorded[i] != replayed[i]), n)
        out.append(FieldDiff(f"<bytes at {i}>", f"<{recorded[i : i + 40]!r}>", f"<{replayed[i : i + 40]!r}>"))
    return out


# ---- reading Kafka ---------------------------------------------------------------------------------


@dataclass
class RecordedCopy:
    """One decision record message as found on the decisions topic."""

    value: bytes
    event_id: str | None
    model: dict[str, Any] | None  # the record's provenance, as plain JSON
    batch: str | None
    batch_pos: int
    where: tuple[int, int]  # (partition, offset) on the decisions topic


@dataclass
class RecordIndex:
    by_input: dict[Position, list[RecordedCopy]] = field(default_factory=lambda: defaultdict(list))
    by_event: dict[str, list[Position]] = field(default_factory=lambda: defaultdict(list))
    by_batch: dict[str, list[tuple[int, Position]]] = field(default_factory=lambda: defaultdict(list))
    unreadable: int = 0  # messages that are not JSON objects with an input position

    def add(self, value: bytes, headers: Iterable[tuple[str, bytes]], where: tuple[int, int]) -> None:
        try:
            obj = orjson.loads(value)
            ref = obj["input"]
            pos: Position = (str(ref["topic"]), int(ref["partition"]), int(ref["offset"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            self.unreadable += 1
            return
        h = dict(headers)
        batch = h.get("prism-batch")
        try:
            batch_pos = int(h.get("prism-batch-pos", b"0"))
        except ValueError:
            batch_pos = 0
        event_id = obj.get("event_id") if isinstance(obj.get("event_id"), str) else None
        model = obj.get("model") if isinstance(obj.get("model"), dict) else None
        copies = self.by_input[pos]
        copy = RecordedCopy(value, event_id, model, batch.decode() if batch else None, batch_pos, where)
        copies.append(copy)
        if len(copies) == 1:
            if event_id is not None:
                self.by_event[event_id].append(pos)
            if copy.batch is not None:
                self.by_batch[copy.batch].append((batch_pos, pos))


def _consumer(bootstrap: str) -> Any:
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",  # aborted transactions (exactly-once mode) are not records
        auto_offset_reset="earliest",
    )


async def topic_partitions(bootstrap: str, topic: str) -> list[int]:
    """The partition ids of `topic` (raises ReplayError when it does not exist)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (meta,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    parts = sorted(p["partition"] for p in meta.get("partitions", ()))
    if meta.get("error_code") or not parts:
        raise ReplayError(f"topic {topic!r} does not exist (or has no partitions)")
    return parts


async def _read_ranges(consumer: Any, ranges: dict[tuple[str, int], tuple[int, int]]) -> list[Any]:
    """Every message with start <= offset < end of each (topic, partition)."""
    from aiokafka import TopicPartition

    wanted = {TopicPartition(t, p): r for (t, p), r in ranges.items() if r[0] < r[1]}
    if not wanted:
        return []
    consumer.assign(list(wanted))
    for tp, (start, _) in wanted.items():
        consumer.seek(tp, start)
    out: list[Any] = []
    open_tps = set(wanted)
    last_progress = time.monotonic()
    while open_tps:
        got = await consumer.getmany(*open_tps, timeout_ms=200)
        for tp, msgs in got.items():
            start, end = wanted[tp]
            out.extend(m for m in msgs if start <= m.offset < end)
            last_progress = time.monotonic()
        for tp in list(open_tps):
            if await consumer.position(tp) >= wanted[tp][1]:
                open_tps.discard(tp)
        if open_tps and time.monotonic() - last_progress > _IDLE_TIMEOUT_S:
            log.warning(
                "replay.read_stalled",
                partitions={f"{tp.topic}/{tp.partition}": wanted[tp] for tp in open_tps},
            )
            break
    return out


async def _end_offsets(
    consumer: Any, topic: str, parts: Sequence[int]
) -> tuple[dict[int, int], dict[int, int]]:
    from aiokafka import TopicPartition

    tps = [TopicPartition(topic, p) for p in parts]
    begin = await consumer.beginning_offsets(tps)
    end = await consumer.end_offsets(tps)
    return {tp.partition: o for tp, o in begin.items()}, {tp.partition: o for tp, o in end.items()}


async def read_records(bootstrap: str, topic: str) -> RecordIndex:
    """Index every decision record on `topic`, as of now, by input position, event id and batch."""
    consumer = _consumer(bootstrap)
    await consumer.start()
    try:
        parts = await topic_partitions(bootstrap, topic)
        begin, end = await _end_offsets(consumer, topic, parts)
        msgs = await _read_ranges(consumer, {(topic, p): (begin[p], end[p]) for p in parts})
    finally:
        await consumer.stop()
    index = RecordIndex()
    for m in sorted(msgs, key=lambda m: (m.partition, m.offset)):
        if m.value is not None:
            index.add(m.value, m.headers or (), (m.partition, m.offset))
    return index


# ---- selection ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """Which input events to replay: a topic range, and/or event ids (found through the records)."""

    topic: str | None = None
    partitions: tuple[int, ...] | None = None  # None: every partition of `topic`
    from_offset: int | None = None  # inclusive; None: the beginning
    to_offset: int | None = None  # exclusive; None: the end (as of the start of the replay)
    from_time: datetime | None = None  # first message with timestamp >= this
    to_time: datetime | None = None  # messages with timestamp < this
    event_ids: tuple[str, ...] = ()

    def check(self) -> None:
        ranged = any(
            v is not None
            for v in (self.partitions, self.from_offset, self.to_offset, self.from_time, self.to_time)
        )
        if ranged and self.topic is None:
            raise ReplayError("an offset or time range needs --topic (the input topic)")
        if self.topic is None and not self.event_ids:
            raise ReplayError("nothing selected: give --topic (with an optional range) or --event-id")
        if (self.from_offset is not None or self.to_offset is not None) and (
            self.from_time is not None or self.to_time is not None
        ):
            raise ReplayError("choose an offset range or a time range, not both")
        for name in ("from_time", "to_time"):
            t = getattr(self, name)
            if t is not None and t.tzinfo is None:
                raise ReplayError(f"--{name.replace('_', '-')} needs a timezone (e.g. 2026-11-28T08:00:00Z)")


async def _range_positions(bootstrap: str, consumer: Any, sel: Selection) -> list[Position]:
    from aiokafka import TopicPartition

    assert sel.topic is not None
    existing = await topic_partitions(bootstrap, sel.topic)
    parts = list(sel.partitions) if sel.partitions is not None else existing
    unknown = sorted(set(parts) - set(existing))
    if unknown:
        raise ReplayError(f"topic {sel.topic!r} has partitions {existing}, not {unknown}")
    begin, end = await _end_offsets(consumer, sel.topic, parts)
    lo = {p: max(begin[p], sel.from_offset or 0) for p in parts}
    hi = {p: end[p] if sel.to_offset is None else min(end[p], sel.to_offset) for p in parts}
    for bound, target in ((sel.from_time, lo), (sel.to_time, hi)):
        if bound is None:
            continue
        ms = int(bound.timestamp() * 1000)
        found = await consumer.offsets_for_times({TopicPartition(sel.topic, p): ms for p in parts})
        for tp, ot in found.items():
            # No message at or after the time: the range runs to (or starts at) the end.
            target[tp.partition] = end[tp.partition] if ot is None else max(begin[tp.partition], ot.offset)
    return [(sel.topic, p, o) for p in parts for o in range(lo[p], hi[p])]


# ---- engines ---------------------------------------------------------------------------------------


class EngineSource:
    """Finds (loads once) the engine a record's provenance names, or refuses.

    `models` are candidate GGUF files (matched by file digest); `engines` are already loaded
    engines (tests, `prism demo`), matched by digest, precision and decision config digest.
    The decision config is `decision_config` (or the one beside the model), with the gate,
    thought budget and mixing weight the record names; its digest must equal the record's.
    """

    def __init__(
        self,
        models: Sequence[Path] = (),
        *,
        decision_config: Path | None = None,
        device: str = "cpu",
        precision: str | None = None,
        engines: Sequence[DecisionEngine] = (),
        cache_bytes: int | None = None,
    ) -> None:
        self.models = list(models)
        self.decision_config = decision_config
        self.device = device
        self.precision = precision
        self.cache_bytes = cache_bytes
        self._digests: dict[tuple[Path, Path | None], str] | None = None
        self._engines: list[DecisionEngine] = list(engines)
        self.notes: list[str] = []

    def _model_digests(self) -> dict[tuple[Path, Path | None], str]:
        """(model, projector or None) -> the digest a record decided with them names. A model
        with an mmproj-*.gguf beside it also matches records decided with that projector."""
        if self._digests is None:
            from engine.engine import model_digest
            from engine.vision.mmproj import find_mmproj

            self._digests = {}
            for p in self.models:
                if not p.is_file():
                    raise ReplayError(f"--model {p}: no such file")
                self._digests[(p, None)] = model_digest(p)
                mmproj = find_mmproj(p)
                if mmproj is not None:
                    self._digests[(p, mmproj)] = model_digest(p, mmproj)
        return self._digests

    def engine_for(self, model: dict[str, Any] | None, what: str) -> DecisionEngine:
        if model is None:
            raise ReplayRefused(f"{what}: the record has no model provenance")
        try:
            digest, precision = str(model["file_digest"]), str(model["precision"])
            cfg_digest = str(model["decision_config_digest"])
            name = str(model.get("name"))
        except KeyError as e:
            raise ReplayRefused(f"{what}: the record's provenance lacks {e}") from None
        if self.precision is not None and self.precision != precision:
            raise ReplayRefused(
                f"{what} was decided on the {precision} path; replay was asked to use {self.precision} "
                "(records are only reproducible on the path that made them)"
            )
        for e in self._engines:
            if (e.model_digest, e.precision, e.decision_config.digest()) == (digest, precision, cfg_digest):
                self._check_versions(e, model)
                return e
        candidates = [files for files, d in self._model_digests().items() if d == digest]
        if not candidates and not self.models and not self._engines:
            raise ReplayRefused(
                f"{what} was decided by model {name!r} with file sha256 {digest}; "
                "pass that model file with --model"
            )
        if not candidates:
            given = (
                ", ".join(
                    f"{p}{f' + {m}' if m else ''} (sha256 {d})" for (p, m), d in self._model_digests().items()
                )
                or "none"
            )
            loaded = ", ".join(f"{e.model_name} (sha256 {e.model_digest})" for e in self._engines)
            raise ReplayRefused(
                f"{what} was decided by model {name!r} with file sha256 {digest}; the model file(s) given "
                f"differ: {given}{'; loaded: ' + loaded if loaded else ''}. "
                "Pass the same model file with --model."
            )
        path, mmproj = candidates[0]
        cfg = self._config_for(path, model, what)
        from prism_pipeline.core.engine_setup import EngineSettings, load_engine

        log.info("replay.loading_model", path=str(path), precision=precision, digest=digest)
        settings = EngineSettings(model=path, device=self.device, precision=precision)  # type: ignore[arg-type]
        engine = load_engine(
            settings,
            decision_config=cfg,  # the one the record names
            mmproj=mmproj or False,  # exactly the files the record names: a projector or none
            cache_bytes=self.cache_bytes,
            watch=False,
        )
        self._engines.append(engine)
        self._check_versions(engine, model)
        return engine

    def _check_versions(self, engine: DecisionEngine, model: dict[str, Any]) -> None:
        # Not a refusal: a new engine version may well reproduce old records. A difference
        # found under a changed renderer or engine is explained by this note.
        for key, mine in (
            ("engine_version", engine.engine_version),
            ("render_version", engine.render_version),
        ):
            theirs = model.get(key)
            note = f"records name {key} {theirs!r}; this replay runs {mine!r}"
            if theirs != mine and note not in self.notes:
                self.notes.append(note)

    def _config_for(self, path: Path, model: dict[str, Any], what: str) -> Any:
        from engine.decision_config import DecisionConfigError, load_decision_config

        source = self.decision_config or path
        try:
            base = load_decision_config(source)
            cfg = dataclasses.replace(
                base,
                gate=float(model["gate"]),
                thought_budget=int(model["thought_budget"]),
                second_weight=float(model["mix_weight"]),
            )
        except (DecisionConfigError, KeyError, TypeError, ValueError) as e:
            raise ReplayRefused(f"{what}: cannot rebuild its decision config from {source}: {e}") from None
        if cfg.digest() != model["decision_config_digest"]:
            raise ReplayRefused(
                f"{what} was decided under decision config sha256 {model['decision_config_digest']}; "
                f"{source} with the record's gate/thought budget/mixing weight gives {cfg.digest()} "
                "(temperatures or thought sampling differ). Pass the worker's decision_config.json "
                "with --decision-config."
            )
        return cfg


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


def _pos_text(p: Position) -> str:
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
                    copy.model, f"record {copy.event_id!r} (input {_pos_text(pos)})"
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
                invalid[pos] = prep
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


async def _fetch_inputs(consumer: Any, positions: Iterable[Position]) -> dict[Position, bytes]:
    spans: dict[tuple[str, int], list[int]] = defaultdict(list)
    for t, p, o in positions:
        spans[(t, p)].append(o)
    ranges = {tp: (min(offs), max(offs) + 1) for tp, offs in spans.items()}
    wanted = set(positions)
    out: dict[Position, bytes] = {}
    for m in await _read_ranges(consumer, ranges):
        pos = (m.topic, m.partition, m.offset)
        if pos in wanted:
            out[pos] = m.value if m.value is not None else b""
    return out


async def _publish(bootstrap: str, topic: str, outcomes: list[EventOutcome], replay_id: str) -> int:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    n = 0
    try:
        for o in outcomes:
            if o.replayed is None or o.event_id is None:
                continue
            headers = [*run_headers(replay_id, 1), ("prism-replay-of", _pos_text(o.position).encode())]
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
    consumer = _consumer(bootstrap)
    await consumer.start()
    try:
        selected: list[Position] = []
        if selection.topic is not None:
            selected = await _range_positions(bootstrap, consumer, selection)
        missing_ids: list[str] = []
        for eid in dict.fromkeys([*selection.event_ids, *([explain_event] if explain_event else [])]):
            found = index.by_event.get(eid)
            if not found:
                missing_ids.append(eid)
            selected.extend(found or ())
        selected = list(dict.fromkeys(selected))
        needed = set(selected)
        for pos in selected:  # batch-mates of reference-path records
            copies = index.by_input.get(pos)
            if copies and copies[0].batch is not None and (copies[0].model or {}).get("precision") != "int8":
                needed.update(p for _, p in index.by_batch[copies[0].batch])
        inputs = await _fetch_inputs(consumer, needed) if needed else {}
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


# ---- rendering and the CLI ---------------------------------------------------------------------------


def _version_summary(report: ReplayReport) -> list[str]:
    """One block per version change: which records it covers and what they still reproduce.

    A new engine or renderer version is allowed to move bits (each version's note in
    engine/engine.py says what moved), so listing every moved float would bury the one fact that
    matters: the records are from another version, and only that version can verify them.
    """
    groups: dict[tuple[tuple[str, str, str], ...], list[EventOutcome]] = defaultdict(list)
    for o in report.outcomes:
        if o.status == "different" and o.version_change:
            groups[o.version_change].append(o)
    lines = []
    for change, members in groups.items():
        what = ", ".join(f"{f} {theirs!r} (this replay: {mine!r})" for f, theirs, mine in change)
        same = sum(1 for o in members if o.only_versions_differ)
        moved = [o for o in members if o.changed_answers]
        lines.append(
            f"VERSION CHANGE: {len(members)} of {report.checked} checked records were decided under {what}; "
            "their differences are expected and not listed field by field (replay under the version "
            "that made them to check them bit for bit)"
        )
        lines.append(
            f"  {same} reproduce every field but the version; {len(members) - same - len(moved)} keep every "
            f"answer but move read-out/thought bits; {len(moved)} change an answer"
        )
    return lines


def render_report(report: ReplayReport, max_diffs: int = 50) -> str:
    lines = _version_summary(report)
    shown = 0
    for o in report.outcomes:
        if o.status not in ("different", "missing"):
            continue
        where = _pos_text(o.position) if o.position[0] else "-"
        lines.append(
            f"{o.status.upper()} {o.event_id or '?'} (input {where}){': ' + o.note if o.note else ''}"
        )
        if o.status == "different" and o.version_change:
            answers = ", ".join(o.changed_answers) or "none"
            lines.append(f"  another version: {len(o.diffs)} field(s) differ; answers changed: {answers}")
            continue
        for d in o.diffs:
            if shown >= max_diffs:
                break
            lines.append(f"  {d.render()}")
            shown += 1
    if shown >= max_diffs:
        lines.append(f"  ... (more differences not shown; --max-diffs {max_diffs})")
    lines.extend(f"note: {n}" for n in report.notes)
    total = len(report.outcomes)
    lines.append(
        f"replay: {total} selected, {report.checked} checked, {report.count('identical')} identical, "
        f"{report.count('different')} different, {report.count('missing')} missing, "
        f"{report.count('invalid') + report.count('rejected')} without a record by design "
        f"(invalid or rejected) in {report.seconds:.1f} s"
        + (f"; {report.published} records published" if report.published else "")
    )
    versioned = sum(1 for o in report.outcomes if o.status == "different" and o.version_change)
    if report.ok:
        lines.append("RESULT: all identical")
    elif versioned and versioned == report.count("different") and not report.count("missing"):
        lines.append("RESULT: DIFFERENCES FOUND, all in records of another engine/render version")
    else:
        lines.append("RESULT: DIFFERENCES FOUND")
    return "\n".join(lines) + "\n"


def _parse_time(text: str) -> datetime:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date-time: {text!r}") from None


def _cmd_replay(args: argparse.Namespace) -> int:
    from prism_pipeline.logs import install_uvloop

    sel = Selection(
        topic=args.topic,
        partitions=tuple(args.partition) if args.partition else None,
        from_offset=args.from_offset,
        to_offset=args.to_offset,
        from_time=args.from_time,
        to_time=args.to_time,
        event_ids=tuple(args.event_id or ()),
    )
    engines = EngineSource(
        [Path(m) for m in args.model],
        decision_config=Path(args.decision_config) if args.decision_config else None,
        device=args.device,
        precision=args.precision,
    )
    options = ReplayOptions(
        seed_policy=args.seed_policy,
        fixed_seed=args.fixed_seed,
        limits=Limits(max_questions=args.max_questions, max_state_chars=args.max_state_chars),
    )
    install_uvloop()
    try:
        report = asyncio.run(
            replay(
                args.brokers,
                args.records,
                sel,
                engines,
                options,
                publish=args.publish,
                explain_event=args.explain,
            )
        )
    except ReplayRefused as e:
        sys.stderr.write(f"prism replay: refusing to replay: {e}\n")
        return 2
    except ReplayError as e:
        sys.stderr.write(f"prism replay: {e}\n")
        return 2
    if report.explain:
        sys.stdout.write(report.explain + "\n")
    sys.stdout.write(render_report(report, args.max_diffs))
    return 0 if report.ok else 1


def add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="re-decide recorded events and compare the decision records bit for bit",
        description=(
            "Select input events (topic + offset or time range, or event ids), re-decide them with the "
            "model and config their records name, and compare the records byte for byte. Exit 0 only "
            "when every selected event's record is identical; 1 on differences or missing records; "
            "2 when replay cannot run (e.g. the model file's digest differs from the records')."
        ),
    )
    p.add_argument("--brokers", default="localhost:9092", help="Kafka bootstrap servers")
    p.add_argument("--records", default="prism.decisions", help="decisions topic (default prism.decisions)")
    p.add_argument("--topic", help="input (evidence) topic to select a range of")
    p.add_argument("--partition", type=int, action="append", help="input partition (repeatable; default all)")
    p.add_argument("--from-offset", type=int, help="first input offset (inclusive)")
    p.add_argument("--to-offset", type=int, help="last input offset (exclusive)")
    p.add_argument("--from-time", type=_parse_time, help="ISO 8601: first message at or after this time")
    p.add_argument("--to-time", type=_parse_time, help="ISO 8601: messages before this time")
    p.add_argument(
        "--event-id", action="append", help="replay this event (repeatable), found via the records"
    )
    p.add_argument("--model", action="append", default=[], help="GGUF file(s) the records were decided with")
    p.add_argument("--decision-config", help="decision_config.json (default: beside the model)")
    p.add_argument("--device", default="cpu", help="engine device (default cpu)")
    p.add_argument(
        "--precision",
        choices=["int8", "bf16", "fp32"],
        help="refuse records of another path (default: theirs)",
    )
    p.add_argument("--seed-policy", default="event", choices=["event", "id", "fixed"], help="as the worker's")
    p.add_argument("--fixed-seed", type=int, default=0, help="as the worker's")
    p.add_argument("--max-questions", type=int, default=64, help="as the worker's")
    p.add_argument("--max-state-chars", type=int, default=1_000_000, help="as the worker's")
    p.add_argument("--publish", metavar="TOPIC", help="also write the replayed records to this topic")
    p.add_argument("--explain", metavar="EVENT_ID", help="print this decision: prompt, thought, read-outs")
    p.add_argument("--max-diffs", type=int, default=50, help="field differences to print (default 50)")
    p.set_defaults(func=_cmd_replay)
