"""Checker: reconcile every input offset with exactly one outcome.

Reads the evidence topic, the decisions topic and the dead-letter topic from the beginning. Each
decision record names its input (`input` {topic, partition, offset}); each dead letter names
topic/partition/offset. For every input offset it finds:
- lost: no outcome at all;
- conflicting: both a record and a dead letter;
- divergent: several outcomes whose value bytes differ (a redelivery decided differently);
- duplicates (allowed under at-least-once): several byte-identical outcomes;
- wrong (with a manifest): a record where a dead letter was owed, or the wrong reason.
Across offsets, records sharing a key whose decision content (the value without `input`) differs
are divergent keys. Outcomes that name an offset the evidence topic does not hold are orphans.
Latency is the first outcome's Kafka timestamp minus the input's.

The topics are read with read-committed isolation (`--isolation read_committed`, the default): in
exactly-once mode an aborted transaction's records stay in the log, and a worker killed mid
transaction leaves exactly such records behind; counted, they would be duplicates (or conflicts)
the pipeline never published. Records written without a transaction (at-least-once) are read
the same under either level. `--isolation read_uncommitted` counts everything in the log.

    python -m ops.load.check --brokers 127.0.0.1:9092 --input-topic prism.evidence \
        --output-topic prism.decisions --dlq-topic prism.dead-letters [--manifest produced.jsonl] \
        [--wait 60] [--isolation read_committed]

Exit status 0 when nothing is lost, conflicting, divergent, wrong or orphaned; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog
from aiokafka import AIOKafkaConsumer

from ops.load.generate import LoadError, Produced, read_manifest, require_loopback

log = structlog.get_logger(__name__)

Offset = tuple[int, int]  # (partition, offset) in the evidence topic
ISOLATION_LEVELS = ("read_committed", "read_uncommitted")


def _digest(data: bytes) -> bytes:
    """What an outcome's bytes are kept as: equal bytes, equal digests. A 100,000-event soak
    would otherwise hold every record twice (value and content, ~3 KB each) in the checker."""
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class _Outcome:
    kind: str  # "record" | "dead_letter"
    key: bytes | None
    value: bytes  # digest of the value bytes
    timestamp_ms: int
    reason: str | None = None
    content: bytes | None = None  # records: digest of the value without `input`, canonical


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    s = sorted(values)
    rank = max(1, -(-len(s) * q // 100))  # ceil(n * q / 100), at least 1
    return s[int(rank) - 1]


@dataclass
class CheckReport:
    inputs: int
    records: int
    dead_letters: int
    lost: list[Offset] = field(default_factory=list)
    conflicting: list[Offset] = field(default_factory=list)
    divergent: list[Offset] = field(default_factory=list)
    divergent_keys: list[str] = field(default_factory=list)
    duplicates: int = 0  # extra byte-identical outcomes (allowed under at-least-once)
    wrong: list[tuple[Offset, str]] = field(default_factory=list)
    orphans: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    latency_ms: list[float] = field(default_factory=list)
    first_input_ms: int | None = None
    last_outcome_ms: int | None = None

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.conflicting
            or self.divergent
            or self.divergent_keys
            or self.wrong
            or self.orphans
        )

    @property
    def complete(self) -> bool:
        """Every input offset has an outcome."""
        return not self.lost

    def summary(self) -> dict[str, Any]:
        span = (
            (self.last_outcome_ms - self.first_input_ms) / 1000.0
            if self.first_input_ms is not None and self.last_outcome_ms is not None
            else None
        )
        return {
            "ok": self.ok,
            "inputs": self.inputs,
            "records": self.records,
            "dead_letters": self.dead_letters,
            "lost": len(self.lost),
            "conflicting": len(self.conflicting),
            "divergent": len(self.divergent),
            "divergent_keys": len(self.divergent_keys),
            "duplicates": self.duplicates,
            "wrong": len(self.wrong),
            "orphans": self.orphans,
            "reasons": dict(sorted(self.reasons.items())),
            "latency_ms": {
                "p50": percentile(self.latency_ms, 50),
                "p99": percentile(self.latency_ms, 99),
                "max": max(self.latency_ms) if self.latency_ms else None,
            },
            "span_s": span,
            "outcomes_per_s": round(self.inputs / span, 3) if span else None,
            "examples": {
                "lost": self.lost[:5],
                "conflicting": self.conflicting[:5],
                "divergent": self.divergent[:5],
                "divergent_keys": self.divergent_keys[:5],
                "wrong": self.wrong[:5],
            },
        }


class _TopicReader:
    """Reads one topic from the beginning, incrementally, without a consumer group.

    Under read_committed the end offsets are the last stable offsets: an open transaction's
    records are read once it commits, an aborted one's never."""

    def __init__(self, bootstrap: str, topic: str, isolation_level: str = "read_committed") -> None:
        self.topic = topic
        # Subscribed without a group: the consumer assigns itself every partition, from the start.
        self._c = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level=isolation_level,
            fetch_max_bytes=64 * 1024 * 1024,
            max_partition_fetch_bytes=32 * 1024 * 1024,
        )

    async def start(self) -> None:
        await self._c.start()

    async def read_new(self, idle_ms: int = 200) -> list[Any]:
        """Everything appended since the last call (up to the end offsets seen now)."""
        parts = sorted(self._c.assignment())
        if not parts:
            await self._c.getmany(timeout_ms=idle_ms)  # lets the assignment happen
            parts = sorted(self._c.assignment())
            if not parts:
                return []
        ends = await self._c.end_offsets(parts)
        out: list[Any] = []
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            behind = [tp for tp in parts if await self._c.position(tp) < ends[tp]]
            if not behind:
                break
            got = await self._c.getmany(*behind, timeout_ms=idle_ms)
            for msgs in got.values():
                out.extend(msgs)
        return out

    async def stop(self) -> None:
        await self._c.stop()


class Checker:
    """Incremental reconciliation of one pipeline's topics; `await update()` then `report()`."""

    def __init__(
        self,
        bootstrap: str,
        input_topic: str,
        output_topic: str,
        dlq_topic: str,
        manifest: Sequence[Produced] | None = None,
        *,
        isolation_level: str = "read_committed",
    ) -> None:
        require_loopback(bootstrap)
        if isolation_level not in ISOLATION_LEVELS:
            raise LoadError(f"isolation level must be one of {ISOLATION_LEVELS}, got {isolation_level!r}")
        self.input_topic = input_topic
        self.isolation_level = isolation_level
        self._readers = {
            "in": _TopicReader(bootstrap, input_topic, isolation_level),
            "out": _TopicReader(bootstrap, output_topic, isolation_level),
            "dlq": _TopicReader(bootstrap, dlq_topic, isolation_level),
        }
        self._inputs: dict[Offset, tuple[bytes | None, int]] = {}  # -> (key, timestamp)
        self._outcomes: dict[Offset, list[_Outcome]] = defaultdict(list)
        self._orphans: list[_Outcome] = []
        self._records = 0
        self._dead_letters = 0
        self._bad_outputs = 0
        self.expect: dict[Offset, Produced] = {}
        if manifest is not None:
            self.set_manifest(manifest)

    def set_manifest(self, manifest: Sequence[Produced]) -> None:
        self.expect = {(p.partition, p.offset): p for p in manifest}

    async def __aenter__(self) -> Checker:
        for r in self._readers.values():
            await r.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for r in self._readers.values():
            await r.stop()

    async def update(self) -> None:
        """Read whatever arrived on the three topics since the last update."""
        for m in await self._readers["in"].read_new():
            self._inputs[(m.partition, m.offset)] = (m.key, m.timestamp)
        for m in await self._readers["out"].read_new():
            self._records += 1
            try:
                doc = orjson.loads(m.value)
                ref = doc["input"]
                where = (ref["topic"], int(ref["partition"]), int(ref["offset"]))
                doc.pop("input")
                content = _digest(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                self._bad_outputs += 1
                continue
            self._place(where, _Outcome("record", m.key, _digest(m.value), m.timestamp, content=content))
        for m in await self._readers["dlq"].read_new():
            self._dead_letters += 1
            try:
                doc = orjson.loads(m.value)
                where = (doc["topic"], int(doc["partition"]), int(doc["offset"]))
                reason = str(doc["reason"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                self._bad_outputs += 1
                continue
            self._place(where, _Outcome("dead_letter", m.key, _digest(m.value), m.timestamp, reason=reason))

    def _place(self, where: tuple[str, int, int], out: _Outcome) -> None:
        topic, partition, offset = where
        if topic != self.input_topic:
            self._orphans.append(out)
            return
        self._outcomes[(partition, offset)].append(out)

    def progress(self) -> tuple[int, int]:
        """(input offsets read, of them with an outcome): cheap, unlike `report`, which a long run
        cannot afford every second."""
        return len(self._inputs), sum(1 for off in self._outcomes if off in self._inputs)

    def outcome_timestamps(self) -> list[int]:
        """Kafka timestamps (ms) of every outcome read so far, sorted: the pipeline's progress over
        time, from which the scenarios measure pauses (failovers, rebalances) and throughput."""
        return sorted(o.timestamp_ms for outs in self._outcomes.values() for o in outs)

    def report(self) -> CheckReport:
        r = CheckReport(inputs=len(self._inputs), records=self._records, dead_letters=self._dead_letters)
        r.orphans = (
            self._bad_outputs
            + len(self._orphans)
            + sum(len(v) for k, v in self._outcomes.items() if k not in self._inputs)
        )
        by_key: dict[bytes, set[bytes]] = defaultdict(set)
        for off in sorted(self._inputs):
            key, ts = self._inputs[off]
            outs = self._outcomes.get(off, [])
            if not outs:
                r.lost.append(off)
                continue
            kinds = {o.kind for o in outs}
            if len(kinds) > 1:
                r.conflicting.append(off)
            elif len({o.value for o in outs}) > 1:
                r.divergent.append(off)
            r.duplicates += len(outs) - 1
            first = min(outs, key=lambda o: o.timestamp_ms)
            r.latency_ms.append(float(first.timestamp_ms - ts))
            r.first_input_ms = ts if r.first_input_ms is None else min(r.first_input_ms, ts)
            last = max(o.timestamp_ms for o in outs)
            r.last_outcome_ms = last if r.last_outcome_ms is None else max(r.last_outcome_ms, last)
            o = outs[0]
            label = "record" if o.kind == "record" else f"dead_letter:{o.reason}"
            r.reasons[label] = r.reasons.get(label, 0) + 1
            for x in outs:
                if x.kind == "record" and x.key is not None and x.content is not None:
                    by_key[x.key].add(x.content)
            want = self.expect.get(off)
            if want is not None:
                got_kind = "record" if o.kind == "record" else "dead_letter"
                if got_kind != want.expect or (want.reason is not None and o.reason != want.reason):
                    r.wrong.append(
                        (off, f"{want.label}: expected {want.expect} {want.reason or ''}, got {label}")
                    )
        r.divergent_keys = sorted(k.decode("utf-8", "replace") for k, v in by_key.items() if len(v) > 1)
        return r

    async def wait_complete(self, timeout_s: float, expected_inputs: int | None = None) -> CheckReport:
        """Update until every input offset (at least `expected_inputs` of them) has an outcome."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.update()
            rep = self.report()
            if rep.complete and (expected_inputs is None or rep.inputs >= expected_inputs):
                return rep
            if time.monotonic() >= deadline:
                log.warning("check.incomplete", lost=len(rep.lost), inputs=rep.inputs)
                return rep
            await asyncio.sleep(0.5)


async def check(
    bootstrap: str,
    input_topic: str,
    output_topic: str,
    dlq_topic: str,
    *,
    manifest: Sequence[Produced] | None = None,
    wait_s: float = 0.0,
    settle_s: float = 1.0,
    isolation_level: str = "read_committed",
) -> CheckReport:
    """One-shot reconciliation; waits up to `wait_s` for outcomes, then `settle_s` for late duplicates."""
    async with Checker(
        bootstrap, input_topic, output_topic, dlq_topic, manifest, isolation_level=isolation_level
    ) as c:
        await c.wait_complete(wait_s)
        await asyncio.sleep(settle_s)
        await c.update()
        return c.report()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.load.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--brokers", required=True)
    p.add_argument("--input-topic", required=True)
    p.add_argument("--output-topic", required=True)
    p.add_argument("--dlq-topic", required=True)
    p.add_argument("--manifest", type=Path, default=None, help="what ops.load.generate produced")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for missing outcomes")
    p.add_argument(
        "--isolation",
        choices=ISOLATION_LEVELS,
        default="read_committed",
        help="read_committed (default): aborted transactions' records are not outcomes",
    )
    a = p.parse_args(argv)
    from prism_pipeline.logs import configure_logging

    configure_logging("WARNING", None)
    try:
        manifest = read_manifest(a.manifest) if a.manifest else None
        rep = asyncio.run(
            check(
                a.brokers,
                a.input_topic,
                a.output_topic,
                a.dlq_topic,
                manifest=manifest,
                wait_s=a.wait,
                isolation_level=a.isolation,
            )
        )
    except (LoadError, OSError) as e:
        sys.stderr.write(f"check: {e}\n")
        return 2
    sys.stdout.write(orjson.dumps(rep.summary(), option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
