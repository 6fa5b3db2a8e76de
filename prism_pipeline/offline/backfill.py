"""`prism backfill`: decide a large, fixed set of evidence events offline, resumably, throughput first.

Input: JSONL files (plain or `.gz`, one event per line, blank lines ignored) read in the order
given, or a topic range (partitions in ascending order, each from its start to its end offset; the
end is fixed when the job starts, so a resumed job reads exactly the same events). Output: JSONL of
decision records (plain or `.gz`) in input order, or a topic (keyed by event id). Invalid lines and
events the engine rejects go to a dead-letter JSONL file (`schemas.deadletter.DeadLetter` per line:
reason, message, field errors, original bytes; for file input `topic` is the file path, `partition`
the file's index in the input list and `offset` its 0-based line number).

Batching is throughput-first: each engine call packs as many events as fit a token budget.

Resumability (no gaps, no duplicates after a crash at any instant):
1. Input is processed in order, in chunks of a fixed number of events. Chunk k starts where chunk
   k-1 ended, so a resumed job cuts (and batches) exactly as an uninterrupted one would, and even
   the batch-shape-dependent fp32/bf16 paths produce the same bytes.
2. A chunk's records and dead letters are appended to their files, flushed and fsync'ed. For
   `.gz` output each chunk is one complete gzip member (concatenated members are one valid gzip
   stream), so a member boundary is a valid place to cut the file.
3. Only then is the checkpoint replaced atomically (write a temporary file, fsync, rename, fsync
   the directory) with the input position after the chunk and both files' byte lengths.
4. On start, an existing checkpoint (for the same job: inputs, model digest, precision, decision
   config, seeding, chunking) is resumed: both files are truncated to the checkpointed lengths,
   which drops whatever a crash left of an unfinished chunk, and input resumes at the checkpointed
   position. A crash before step 3 redoes the chunk; after it, the next chunk. Either way every
   input event is written exactly once.
With a topic as output, step 4 cannot truncate: a crash between steps 2 and 3 republishes that
chunk's records (byte-identical values under the same keys, which a compacted topic collapses).

Tests crash the job at chosen points with `PRISM_BACKFILL_CRASH=CHUNK:POINT` (POINT `mid-output`:
after writing half a chunk's output; `before-checkpoint`: after both writes), which SIGKILLs the
process there. It exists for tests only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import hashlib
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
import structlog

from prism_pipeline.core.batching import pack
from prism_pipeline.core.decide import DecisionRules, Origin, Prepared, decide_batch, prepare, settle
from prism_pipeline.core.records import DecisionEngine, provenance, run_headers
from prism_pipeline.core.seeds import SeedPolicy
from schemas.codec import dumps
from schemas.deadletter import InvalidEvent
from schemas.record import DecisionRecord, InputRef, record_key
from schemas.systemone import Limits

log = structlog.get_logger(__name__)

CHECKPOINT_VERSION = 1
CRASH_ENV = "PRISM_BACKFILL_CRASH"


class BackfillError(RuntimeError):
    """The job cannot start or continue; the message says why."""


# ---- input ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One input event as read: raw bytes and where they came from."""

    raw: bytes
    topic: str  # file path for file input
    partition: int  # file index for file input
    offset: int  # line number (0-based) for file input
    key: bytes | None = None
    from_topic: bool = False

    def origin(self) -> Origin:
        return Origin(self.topic, self.partition, self.offset, self.key)

    def input_ref(self) -> InputRef | None:
        # Records point at their input only where replay can find it again: a topic position.
        return (
            InputRef(topic=self.topic, partition=self.partition, offset=self.offset)
            if self.from_topic
            else None
        )


Position = dict[str, int]


class FileSource:
    """JSONL files, plain or gzip; position = (file index, line number, byte offset of the line)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        if not paths:
            raise BackfillError("no input files")
        for p in paths:
            if not p.is_file():
                raise BackfillError(f"input file not found: {p}")
        self.paths = list(paths)

    def describe(self) -> dict[str, Any]:
        return {"files": [{"path": str(p.resolve()), "size": p.stat().st_size} for p in self.paths]}

    @staticmethod
    def _open(path: Path) -> IO[bytes]:
        if path.suffix == ".gz":
            return gzip.open(path, "rb")  # type: ignore[return-value]
        return path.open("rb")

    def total(self) -> int:
        n = 0
        for p in self.paths:
            with self._open(p) as f:
                n += sum(1 for line in f if line.strip())
        return n

    async def items(self, start: Position) -> AsyncIterator[tuple[Item, Position]]:
        for i in range(start.get("file", 0), len(self.paths)):
            path = self.paths[i]
            first = i == start.get("file", 0)
            line_no, byte = (start.get("line", 0), start.get("byte", 0)) if first else (0, 0)
            try:
                f = self._open(path)
            except OSError as e:
                raise BackfillError(f"cannot read {path}: {e}") from None
            with f:
                if path.suffix == ".gz":  # gzip seeks by decompressing anyway: skip whole lines
                    for _ in range(line_no):
                        byte += len(f.readline())
                else:
                    f.seek(byte)
                try:
                    for line in f:
                        n, byte = line_no, byte + len(line)
                        line_no += 1
                        raw = line.rstrip(b"\r\n")
                        if not raw.strip():
                            continue
                        yield Item(raw, str(path), i, n), {"file": i, "line": line_no, "byte": byte}
                except (OSError, EOFError, gzip.BadGzipFile) as e:
                    raise BackfillError(f"{path}: unreadable after line {line_no}: {e}") from None


class TopicSource:
    """A fixed range of a topic: partitions ascending, offsets ascending; position = (index, offset)."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partitions: Sequence[int] | None = None,
        from_offset: int | None = None,
        to_offset: int | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.partitions = partitions
        self.from_offset = from_offset
        self.to_offset = to_offset
        self.ranges: list[tuple[int, int, int]] = []  # (partition, start, end)

    async def resolve(self, fixed: list[list[int]] | None = None) -> None:
        """Fix the range (from a checkpoint's description when resuming)."""
        if fixed is not None:
            self.ranges = [(p, s, e) for p, s, e in fixed]
            return
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from prism_pipeline.offline.replay import ReplayError, topic_partitions

        try:
            existing = await topic_partitions(self.bootstrap, self.topic)
        except ReplayError as e:
            raise BackfillError(str(e)) from None
        parts = sorted(self.partitions) if self.partitions else existing
        if set(parts) - set(existing):
            raise BackfillError(f"topic {self.topic!r} has partitions {existing}, not {parts}")
        tps = [TopicPartition(self.topic, p) for p in parts]
        c = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False)
        await c.start()
        try:
            begin, end = await c.beginning_offsets(tps), await c.end_offsets(tps)
        finally:
            await c.stop()
        self.ranges = []
        for tp in tps:
            lo = max(begin[tp], self.from_offset or 0)
            hi = end[tp] if self.to_offset is None else min(end[tp], self.to_offset)
            self.ranges.append((tp.partition, lo, max(lo, hi)))

    def describe(self) -> dict[str, Any]:
        return {"topic": self.topic, "ranges": [list(r) for r in self.ranges]}

    def total(self) -> int:
        return sum(e - s for _, s, e in self.ranges)

    async def items(self, start: Position) -> AsyncIterator[tuple[Item, Position]]:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        c = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=None,
            enable_auto_commit=False,
            isolation_level="read_committed",
        )
        await c.start()
        try:
            for i in range(start.get("part", 0), len(self.ranges)):
                part, lo, hi = self.ranges[i]
                if i == start.get("part", 0):
                    lo = max(lo, start.get("offset", lo))
                if lo >= hi:
                    continue
                tp = TopicPartition(self.topic, part)
                c.assign([tp])
                c.seek(tp, lo)
                while await c.position(tp) < hi:
                    got = await c.getmany(tp, timeout_ms=500)
                    for m in got.get(tp, []):
                        if m.offset >= hi:
                            break
                        item = Item(m.value or b"", self.topic, part, m.offset, m.key, from_topic=True)
                        yield item, {"part": i, "offset": m.offset + 1}
        finally:
            await c.stop()


# ---- output -----------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileSink:
    """An append-only JSONL file (gzip: one member per chunk) that can be cut back to a length."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gz = path.suffix == ".gz"
        self._f: IO[bytes] | None = None

    def open(self, length: int) -> None:
        """Open for appending after truncating to `length` (0: start afresh)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size < length:
            raise BackfillError(
                f"{self.path} is {self.path.stat().st_size} bytes, shorter than the checkpointed {length}: "
                "it was modified outside the job; delete the checkpoint to start over"
            )
        f = self.path.open("r+b" if self.path.exists() else "w+b")
        f.truncate(length)
        f.seek(length)
        os.fsync(f.fileno())
        self._f = f

    def encode(self, lines: list[bytes]) -> bytes:
        if not lines:
            return b""
        data = b"".join(line + b"\n" for line in lines)
        return gzip.compress(data, compresslevel=6, mtime=0) if self.gz else data

    def write(self, data: bytes) -> None:
        assert self._f is not None
        self._f.write(data)
        self._f.flush()
        os.fsync(self._f.fileno())

    def tell(self) -> int:
        assert self._f is not None
        return self._f.tell()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class TopicSink:
    """Records to a topic, keyed by event id; waits for every ack before the checkpoint moves."""

    def __init__(self, bootstrap: str, topic: str, job_id: str) -> None:
        self.bootstrap, self.topic, self.job_id = bootstrap, topic, job_id
        self._producer: Any = None
        self.sent = 0

    async def start(self) -> None:
        from aiokafka import AIOKafkaProducer

        self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all")
        await self._producer.start()

    async def send(self, records: list[_Out], chunk: int) -> None:
        base = [*run_headers(self.job_id, 1), ("prism-backfill", self.job_id.encode())]
        futs = []
        for r in records:
            # The engine call that decided it, as the worker labels it: replay re-forms these
            # batches on the reference paths, which are not batch invariant.
            headers = [
                *base,
                ("prism-batch", f"{self.job_id}/{chunk}/{r.batch}".encode()),
                ("prism-batch-pos", str(r.batch_pos).encode()),
                ("prism-batch-events", str(r.batch_size).encode()),
            ]
            futs.append(
                await self._producer.send(self.topic, r.value, key=record_key(r.event_id), headers=headers)
            )
        for f in futs:
            await f
        self.sent += len(futs)

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()


# ---- checkpoint ---------------------------------------------------------------------------------------


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise BackfillError(f"checkpoint {path} is unreadable ({e}); delete it to start over") from None
    if not isinstance(data, dict) or data.get("version") != CHECKPOINT_VERSION:
        raise BackfillError(f"checkpoint {path} is not a version {CHECKPOINT_VERSION} backfill checkpoint")
    return data


def write_checkpoint(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace the checkpoint: a crash leaves either the old or the new one, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(orjson.dumps(data, option=orjson.OPT_INDENT_2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path)


def _crash_point(chunk: int, point: str) -> None:
    """Tests only: SIGKILL ourselves at `point` of chunk `chunk` (see the module docstring)."""
    spec = os.environ.get(CRASH_ENV)
    if spec and spec == f"{chunk}:{point}":
        log.warning("backfill.injected_crash", chunk=chunk, point=point)
        os.kill(os.getpid(), signal.SIGKILL)


# ---- progress -----------------------------------------------------------------------------------------


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Progress on a terminal (`write` set: one `\\r`-rewritten line) or as periodic log lines."""

    def __init__(
        self,
        total: int | None,
        done: int,
        write: Callable[[str], Any] | None = None,
        log_every_s: float = 10.0,
    ) -> None:
        self.total, self.start_done, self.write = total, done, write
        self.log_every_s = log_every_s
        self.t0 = time.monotonic()
        self._last = 0.0

    def update(self, done: int, dead: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < (0.2 if self.write else self.log_every_s):
            return
        self._last = now
        rate = (done - self.start_done) / max(now - self.t0, 1e-9)
        left = None if self.total is None or rate <= 0 else (self.total - done) / rate
        if self.write is None:
            log.info(
                "backfill.progress",
                events=done,
                total=self.total,
                dead_letters=dead,
                events_per_s=round(rate, 2),
                eta_s=None if left is None else round(left),
            )
            return
        width = 30
        frac = 0.0 if not self.total else min(1.0, done / self.total)
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        of = f"/{self.total}" if self.total is not None else ""
        eta = f"ETA {_duration(left)}" if left is not None else "ETA ?"
        line = f"\r[{bar}] {done}{of} events  {rate:.1f} ev/s  {eta}  dlq {dead} "
        self.write(line + ("\n" if final else ""))


# ---- the job --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackfillOptions:
    chunk_events: int = 256  # events per checkpoint
    batch_tokens: int = 32768  # token budget of one engine call
    max_batch_events: int = 256
    seed_policy: SeedPolicy = "event"
    fixed_seed: int = 0
    limits: Limits | None = None
    overwrite: bool = False
    max_gate: float | None = None  # highest gate an event may ask for (None: any)

    def rules(self) -> DecisionRules:
        return DecisionRules(self.limits, self.seed_policy, self.fixed_seed, self.max_gate)


@dataclass
class BackfillSummary:
    events: int = 0  # input events processed, over the whole job (resumes included)
    records: int = 0
    dead_letters: int = 0
    dead_letter_reasons: dict[str, int] = field(default_factory=dict)
    questions: int = 0
    thought_questions: int = 0  # questions that went through AutoThink
    chunks: int = 0
    resumed_at: int = 0  # events already done when this run started
    seconds: float = 0.0  # this run
    already_complete: bool = False

    @property
    def events_this_run(self) -> int:
        return self.events - self.resumed_at

    @property
    def events_per_s(self) -> float:
        return self.events_this_run / self.seconds if self.seconds > 0 else 0.0

    @property
    def autothink_rate(self) -> float:
        return self.thought_questions / self.questions if self.questions else 0.0

    def counters(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "records": self.records,
            "dead_letters": self.dead_letters,
            "dead_letter_reasons": self.dead_letter_reasons,
            "questions": self.questions,
            "thought_questions": self.thought_questions,
        }


@dataclass(frozen=True)
class _Out:
    event_id: str
    value: bytes
    batch: str  # engine call within the chunk
    batch_pos: int
    batch_size: int


@dataclass
class _ChunkOut:
    records: list[_Out]  # input order
    dead: list[bytes]
    reasons: Counter[str]
    questions: int
    thought: int


def decide_chunk(engine: DecisionEngine, items: list[Item], options: BackfillOptions) -> _ChunkOut:
    """Decide one chunk: outcomes in input order (pure: the same chunk gives the same bytes)."""
    model = provenance(engine)
    rules = options.rules()
    outcome: dict[int, _Out | bytes] = {}
    reasons: Counter[str] = Counter()
    live: list[tuple[tuple[int, Prepared], int]] = []
    for i, it in enumerate(items):
        prep = prepare(it.raw, engine, rules)
        if isinstance(prep, InvalidEvent):
            outcome[i] = dumps(it.origin().dead_letter(it.raw, prep))
            reasons[str(prep.reason)] += 1
            continue
        live.append(((i, prep), prep.tokens))
    questions = thought = 0
    for b, group in enumerate(pack(live, options.batch_tokens, options.max_batch_events)):
        decided = decide_batch(engine.decide, [prep.request for _, prep in group])
        for pos, ((i, prep), res) in enumerate(zip(group, decided.results, strict=True)):
            it = items[i]
            done = settle(it.raw, prep, res, model, it.origin(), source=it.input_ref())
            if isinstance(done, DecisionRecord):
                label = (f"{b}.{pos}", 0, 1) if decided.alone else (str(b), pos, len(group))
                outcome[i] = _Out(done.event_id, dumps(done), *label)
                questions += len(done.questions)
                thought += sum(1 for t in done.questions.values() if t.second is not None)
            else:
                outcome[i] = dumps(done)
                reasons[str(done.reason)] += 1
    recs = [o for _, o in sorted(outcome.items()) if isinstance(o, _Out)]
    dead = [o for _, o in sorted(outcome.items()) if isinstance(o, bytes)]
    return _ChunkOut(recs, dead, reasons, questions, thought)


def job_description(
    source: FileSource | TopicSource, engine: DecisionEngine, options: BackfillOptions
) -> dict:
    """What makes two runs the same job (a checkpoint resumes only its own job)."""
    return {
        "input": source.describe(),
        "model_digest": engine.model_digest,
        "precision": engine.precision,
        "decision_config_digest": engine.decision_config.digest(),
        "engine_version": engine.engine_version,
        "seed_policy": options.seed_policy,
        "fixed_seed": options.fixed_seed,
        "chunk_events": options.chunk_events,
        "batch_tokens": options.batch_tokens,
        "max_batch_events": options.max_batch_events,
        "limits": None if options.limits is None else dataclasses.asdict(options.limits),
        **({} if options.max_gate is None else {"max_gate": options.max_gate}),
    }


def _differences(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


async def run_backfill(
    engine: DecisionEngine,
    source: FileSource | TopicSource,
    *,
    output: Path | None = None,
    output_topic: tuple[str, str] | None = None,  # (bootstrap, topic)
    dlq: Path,
    checkpoint: Path,
    options: BackfillOptions = BackfillOptions(),
    progress_write: Callable[[str], Any] | None = None,
) -> BackfillSummary:
    """Run (or resume) a backfill job; see the module docstring for the guarantees."""
    if (output is None) == (output_topic is None):
        raise BackfillError("give exactly one output: a file or a topic")
    if options.chunk_events < 1 or options.batch_tokens < 1 or options.max_batch_events < 1:
        raise BackfillError("chunk_events, batch_tokens and max_batch_events must be >= 1")
    t0 = time.monotonic()
    state = read_checkpoint(checkpoint)
    if isinstance(source, TopicSource):
        await source.resolve(state["job"]["input"]["ranges"] if state else None)
    job = job_description(source, engine, options)
    job["output"] = str(output.resolve()) if output else f"topic:{output_topic[1]}"  # type: ignore[index]
    job["dlq"] = str(dlq.resolve())
    summary = BackfillSummary()
    if state is not None:
        diff = _differences(state["job"], job)
        if diff:
            raise BackfillError(
                f"checkpoint {checkpoint} belongs to another job (differs in: {', '.join(diff)}); "
                "delete it to start over, or pass the same inputs and settings"
            )
        c = state["counters"]
        summary = BackfillSummary(
            events=c["events"],
            records=c["records"],
            dead_letters=c["dead_letters"],
            dead_letter_reasons=dict(c["dead_letter_reasons"]),
            questions=c["questions"],
            thought_questions=c["thought_questions"],
            chunks=state["chunks"],
            resumed_at=c["events"],
        )
        if state.get("done"):
            summary.already_complete = True
            log.info("backfill.already_complete", checkpoint=str(checkpoint), events=summary.events)
            return summary
        log.info(
            "backfill.resuming", checkpoint=str(checkpoint), events=summary.events, chunks=summary.chunks
        )
    else:
        for target in (output, dlq):
            if target is not None and target.exists() and target.stat().st_size and not options.overwrite:
                raise BackfillError(
                    f"{target} exists and there is no checkpoint; pass --overwrite to replace it"
                )
        state = {"position": {}, "output_bytes": 0, "dlq_bytes": 0}

    out_sink = FileSink(output) if output is not None else None
    job_id = f"backfill-{hashlib.sha256(orjson.dumps(job)).hexdigest()[:12]}"
    topic_sink = TopicSink(*output_topic, job_id=job_id) if output_topic else None
    dlq_sink = FileSink(dlq)
    if out_sink is not None:
        out_sink.open(state["output_bytes"])
    dlq_sink.open(state["dlq_bytes"])
    if topic_sink is not None:
        await topic_sink.start()
    total = await asyncio.to_thread(source.total)
    progress = Progress(total, summary.events, progress_write)
    position: Position = dict(state["position"])
    try:
        chunk: list[Item] = []
        after: Position = position

        async def flush() -> None:
            nonlocal chunk, position
            k = summary.chunks + 1
            res = await asyncio.to_thread(decide_chunk, engine, chunk, options)
            if out_sink is not None:
                data = out_sink.encode([r.value for r in res.records])
                if os.environ.get(CRASH_ENV) == f"{k}:mid-output":
                    out_sink.write(data[: len(data) // 2])
                    _crash_point(k, "mid-output")
                out_sink.write(data)
            else:
                assert topic_sink is not None
                await topic_sink.send(res.records, k)
            dlq_sink.write(dlq_sink.encode(res.dead))
            _crash_point(k, "before-checkpoint")
            summary.events += len(chunk)
            summary.records += len(res.records)
            summary.dead_letters += len(res.dead)
            for r, n in res.reasons.items():
                summary.dead_letter_reasons[r] = summary.dead_letter_reasons.get(r, 0) + n
            summary.questions += res.questions
            summary.thought_questions += res.thought
            summary.chunks = k
            position = after
            write_checkpoint(checkpoint, _state(job, position, out_sink, dlq_sink, summary, done=False))
            chunk = []
            progress.update(summary.events, summary.dead_letters)

        async for item, pos in source.items(position):
            chunk.append(item)
            after = pos
            if len(chunk) >= options.chunk_events:
                await flush()
        if chunk:
            await flush()
        write_checkpoint(checkpoint, _state(job, position, out_sink, dlq_sink, summary, done=True))
    finally:
        if out_sink is not None:
            out_sink.close()
        dlq_sink.close()
        if topic_sink is not None:
            await topic_sink.stop()
    summary.seconds = time.monotonic() - t0
    progress.update(summary.events, summary.dead_letters, final=True)
    log.info(
        "backfill.done",
        events=summary.events,
        records=summary.records,
        dead_letters=summary.dead_letters,
        events_per_s=round(summary.events_per_s, 3),
        autothink_rate=round(summary.autothink_rate, 4),
    )
    return summary


def _state(
    job: dict, position: Position, out: FileSink | None, dlq: FileSink, s: BackfillSummary, *, done: bool
) -> dict[str, Any]:
    return {
        "version": CHECKPOINT_VERSION,
        "job": job,
        "position": position,
        "output_bytes": out.tell() if out is not None else 0,
        "dlq_bytes": dlq.tell(),
        "chunks": s.chunks,
        "counters": s.counters(),
        "done": done,
    }


# ---- CLI -------------------------------------------------------------------------------------------------


def render_summary(s: BackfillSummary, output: str, dlq: str) -> str:
    if s.already_complete:
        head = f"backfill already complete (checkpoint): {s.events} events"
    else:
        head = (
            f"backfill: {s.events} events ({s.events_this_run} in this run"
            + (f", resumed after {s.resumed_at}" if s.resumed_at else "")
            + f") in {s.seconds:.1f} s: {s.events_per_s:.2f} events/s"
        )
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.dead_letter_reasons.items()))
    return (
        f"{head}\n"
        f"  {s.records} records -> {output}\n"
        f"  {s.dead_letters} dead letters -> {dlq}{' (' + reasons + ')' if reasons else ''}\n"
        f"  {s.questions} questions, AutoThink on {s.thought_questions} ({100 * s.autothink_rate:.1f}%)\n"
    )


def _cmd_backfill(args: argparse.Namespace) -> int:
    from prism_pipeline.core.engine_setup import ConfigError, EngineSettings, load_engine

    if bool(args.input) == bool(args.input_topic):
        sys.stderr.write("prism backfill: give input files or --input-topic (one of them)\n")
        return 2
    if bool(args.output) == bool(args.output_topic):
        sys.stderr.write("prism backfill: give --output FILE or --output-topic TOPIC (one of them)\n")
        return 2
    output = Path(args.output) if args.output else None
    if output is None and (args.checkpoint is None or args.dlq is None):
        sys.stderr.write("prism backfill: with --output-topic, --checkpoint and --dlq are required\n")
        return 2
    base = output or Path("backfill")
    checkpoint = Path(args.checkpoint) if args.checkpoint else base.with_name(base.name + ".checkpoint")
    dlq = Path(args.dlq) if args.dlq else base.with_name(base.name + ".dlq.jsonl")
    try:
        settings = EngineSettings(
            model=args.model,
            decision_config=args.decision_config,
            device=args.device,
            precision=args.precision,
            tp=args.tp,
            gate=args.gate,
            thought_budget=args.thought_budget,
        )
    except ValueError as e:
        sys.stderr.write(f"prism backfill: invalid settings: {e}\n")
        return 2
    source: FileSource | TopicSource
    try:
        if args.input:
            source = FileSource([Path(p) for p in args.input])
        else:
            source = TopicSource(
                args.brokers, args.input_topic, args.partition, args.from_offset, args.to_offset
            )
        engine = load_engine(settings)
    except (BackfillError, ConfigError) as e:
        sys.stderr.write(f"prism backfill: {e}\n")
        return 2
    options = BackfillOptions(
        chunk_events=args.chunk_events,
        batch_tokens=args.batch_tokens,
        max_batch_events=args.max_batch_events,
        seed_policy=args.seed_policy,
        fixed_seed=args.fixed_seed,
        limits=Limits(max_questions=args.max_questions, max_state_chars=args.max_state_chars),
        overwrite=args.overwrite,
        max_gate=args.max_gate,
    )
    tty = sys.stderr.isatty() and not args.no_progress
    try:
        summary = asyncio.run(
            run_backfill(
                engine,
                source,
                output=output,
                output_topic=(args.brokers, args.output_topic) if args.output_topic else None,
                dlq=dlq,
                checkpoint=checkpoint,
                options=options,
                progress_write=(lambda s: (sys.stderr.write(s), sys.stderr.flush())) if tty else None,
            )
        )
    except BackfillError as e:
        sys.stderr.write(f"prism backfill: {e}\n")
        return 2
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()  # tensor parallel: stops the follower ranks
    sys.stdout.write(render_summary(summary, str(output or f"topic {args.output_topic}"), str(dlq)))
    return 0


def add_backfill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "backfill",
        help="decide events from JSONL files or a topic range offline (resumable)",
        description=(
            "Decide every event of JSONL files (plain or .gz) or a topic range and write the records to "
            "JSONL (plain or .gz) or a topic. Throughput-first batching; a checkpoint makes a killed job "
            "resumable with no gaps or duplicates: rerun the same command."
        ),
    )
    p.add_argument("input", nargs="*", help="JSONL event files, in order (.gz: gzip)")
    p.add_argument("--input-topic", help="read a topic range instead of files")
    p.add_argument("--partition", type=int, action="append", help="input partition (repeatable; default all)")
    p.add_argument("--from-offset", type=int, help="first input offset (inclusive)")
    p.add_argument("--to-offset", type=int, help="input offsets before this (default: the end at job start)")
    p.add_argument("--output", "-o", help="records JSONL file (.gz: gzip)")
    p.add_argument("--output-topic", help="publish records to this topic instead")
    p.add_argument("--dlq", help="dead-letter JSONL file (default OUTPUT.dlq.jsonl)")
    p.add_argument("--checkpoint", help="checkpoint file (default OUTPUT.checkpoint)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace existing output when there is no checkpoint"
    )
    p.add_argument("--brokers", default="localhost:9092", help="Kafka bootstrap servers (topic input/output)")
    p.add_argument("--model", required=True, help="GGUF model file")
    p.add_argument("--decision-config", help="decision_config.json (default: beside the model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="auto", choices=["auto", "int8", "bf16", "fp32"])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (int8; cuda -> cuda:0..N-1)")
    p.add_argument("--gate", type=float, help="AutoThink gate (default: the model's config)")
    p.add_argument("--thought-budget", type=int, help="AutoThink thought token budget (and events' most)")
    p.add_argument(
        "--max-gate", type=float, default=None, help="highest gate an event may ask for (default any)"
    )
    p.add_argument("--seed-policy", default="event", choices=["event", "id", "fixed"])
    p.add_argument("--fixed-seed", type=int, default=0)
    p.add_argument("--chunk-events", type=int, default=256, help="events per checkpoint (default 256)")
    p.add_argument("--batch-tokens", type=int, default=32768, help="token budget of one engine call")
    p.add_argument("--max-batch-events", type=int, default=256, help="events per engine call (default 256)")
    p.add_argument("--max-questions", type=int, default=64)
    p.add_argument("--max-state-chars", type=int, default=1_000_000)
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.set_defaults(func=_cmd_backfill)
