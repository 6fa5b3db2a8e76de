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

Several processes (`--processes N`, see `prism_pipeline.offline.shards`): each runs this job as
one shard, deciding every N-th chunk of the same cut, with its own files and checkpoint; the
shards' chunks are merged, in order, to the one output.

Tests crash the job at chosen points with `PRISM_BACKFILL_CRASH=CHUNK:POINT` (CHUNK: 1-based,
counted over the whole input, so under `--processes` only the shard that owns it dies; POINT
`mid-output`: after writing half a chunk's output; `before-checkpoint`: after both writes), which
SIGKILLs the process there. It exists for tests only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog

from prism_pipeline.core.batching import pack
from prism_pipeline.core.decide import DecisionRules, Prepared, decide_batch, prepare, settle
from prism_pipeline.core.records import DecisionEngine, provenance
from prism_pipeline.core.seeds import SeedPolicy
from prism_pipeline.offline.checkpoint import CHECKPOINT_VERSION, read_checkpoint, write_checkpoint
from prism_pipeline.offline.errors import BackfillError
from prism_pipeline.offline.progress import Progress
from prism_pipeline.offline.shards import Shard
from prism_pipeline.offline.sinks import FileSink, RecordLine, TopicSink
from prism_pipeline.offline.sources import FileSource, Item, Position, TopicSource
from schemas.codec import dumps
from schemas.deadletter import InvalidEvent
from schemas.record import DecisionRecord
from schemas.systemone import Limits

log = structlog.get_logger(__name__)

CRASH_ENV = "PRISM_BACKFILL_CRASH"


def _crash_point(chunk: int, point: str) -> None:
    """Tests only: SIGKILL ourselves at `point` of chunk `chunk` (see the module docstring)."""
    spec = os.environ.get(CRASH_ENV)
    if spec and spec == f"{chunk}:{point}":
        log.warning("backfill.injected_crash", chunk=chunk, point=point)
        os.kill(os.getpid(), signal.SIGKILL)


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

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BackfillSummary:
        """The counters a checkpoint holds (the job so far), as of the start of this run."""
        c = state["counters"]
        return cls(
            events=c["events"],
            records=c["records"],
            dead_letters=c["dead_letters"],
            dead_letter_reasons=dict(c["dead_letter_reasons"]),
            questions=c["questions"],
            thought_questions=c["thought_questions"],
            chunks=state["chunks"],
            resumed_at=c["events"],
        )

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


@dataclass
class _ChunkOut:
    records: list[RecordLine]  # input order
    dead: list[bytes]
    reasons: Counter[str]
    questions: int
    thought: int


def decide_chunk(engine: DecisionEngine, items: list[Item], options: BackfillOptions) -> _ChunkOut:
    """Decide one chunk: outcomes in input order (pure: the same chunk gives the same bytes)."""
    model = provenance(engine)
    rules = options.rules()
    outcome: dict[int, RecordLine | bytes] = {}
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
                outcome[i] = RecordLine(done.event_id, dumps(done), *label)
                questions += len(done.questions)
                thought += sum(1 for t in done.questions.values() if t.second is not None)
            else:
                outcome[i] = dumps(done)
                reasons[str(done.reason)] += 1
    recs = [o for _, o in sorted(outcome.items()) if isinstance(o, RecordLine)]
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
    shard: Shard | None = None,
) -> BackfillSummary:
    """Run (or resume) a backfill job; see the module docstring for the guarantees.

    With `shard`, run that shard of the job: `output`, `dlq` and `checkpoint` name the merged
    files, and the shard writes its own beside them (`Shard.path`), plus its chunk index."""
    if (output is None) == (output_topic is None):
        raise BackfillError("give exactly one output: a file or a topic")
    if options.chunk_events < 1 or options.batch_tokens < 1 or options.max_batch_events < 1:
        raise BackfillError("chunk_events, batch_tokens and max_batch_events must be >= 1")
    t0 = time.monotonic()
    merged_names = (output, dlq)
    index_path = None
    if shard is not None:
        index_path = shard.index_path(checkpoint)
        output = shard.path(output) if output is not None else None
        dlq, checkpoint = shard.path(dlq), shard.path(checkpoint)
    state = read_checkpoint(checkpoint)
    if isinstance(source, TopicSource):
        await source.resolve(state["job"]["input"]["ranges"] if state else None)
    job = job_description(source, engine, options)
    # A shard's job names the merged files, so every shard's job (less "shard") is the same, and
    # its job id (topic headers) is the single process's.
    merged_out, merged_dlq = merged_names
    job["output"] = str(merged_out.resolve()) if merged_out else f"topic:{output_topic[1]}"  # type: ignore[index]
    job["dlq"] = str(merged_dlq.resolve())
    job_id = f"backfill-{hashlib.sha256(orjson.dumps(job)).hexdigest()[:12]}"
    if shard is not None:
        job["shard"] = [shard.number, shard.count]
    summary = BackfillSummary()
    if state is not None:
        diff = _differences(state["job"], job)
        if diff:
            raise BackfillError(
                f"checkpoint {checkpoint} belongs to another job (differs in: {', '.join(diff)}); "
                "delete it to start over, or pass the same inputs and settings"
            )
        summary = BackfillSummary.from_state(state)
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
        state = {"position": {}, "output_bytes": 0, "dlq_bytes": 0, "index_bytes": 0}

    out_sink = FileSink(output) if output is not None else None
    topic_sink = TopicSink(*output_topic, job_id=job_id) if output_topic else None
    dlq_sink = FileSink(dlq)
    if out_sink is not None:
        out_sink.open(state["output_bytes"])
    dlq_sink.open(state["dlq_bytes"])
    index_sink = FileSink(index_path) if index_path is not None else None
    if index_sink is not None:
        index_sink.open(state["index_bytes"])
    if topic_sink is not None:
        await topic_sink.start()
    total = await asyncio.to_thread(source.total)
    if shard is not None:
        total = shard.share(total, options.chunk_events)
    progress = Progress(total, summary.events, progress_write)
    position: Position = dict(state["position"])
    # The global index of the chunk that starts at `position` (a shard skips the others' chunks).
    next_chunk: int = state.get("next_chunk", summary.chunks)
    try:
        chunk: list[Item] = []
        after: Position = position

        async def flush(g: int) -> None:
            nonlocal chunk, position, next_chunk
            k = g + 1
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
            if index_sink is not None:
                out_end = out_sink.tell() if out_sink is not None else 0
                index_sink.write(f"{g} {out_end} {dlq_sink.tell()}\n".encode())
            _crash_point(k, "before-checkpoint")
            summary.events += len(chunk)
            summary.records += len(res.records)
            summary.dead_letters += len(res.dead)
            for r, n in res.reasons.items():
                summary.dead_letter_reasons[r] = summary.dead_letter_reasons.get(r, 0) + n
            summary.questions += res.questions
            summary.thought_questions += res.thought
            summary.chunks += 1
            position, next_chunk = after, g + 1
            sinks = (out_sink, dlq_sink, index_sink)
            write_checkpoint(checkpoint, _state(job, position, next_chunk, sinks, summary, done=False))
            chunk = []
            progress.update(summary.events, summary.dead_letters)

        g, seen = next_chunk, 0
        async for item, pos in source.items(position):
            if shard is None or shard.owns(g):
                chunk.append(item)
            seen += 1
            after = pos
            if seen == options.chunk_events:
                if chunk:
                    await flush(g)
                g, seen = g + 1, 0
        if chunk:
            await flush(g)
        sinks = (out_sink, dlq_sink, index_sink)
        write_checkpoint(checkpoint, _state(job, position, next_chunk, sinks, summary, done=True))
    finally:
        if out_sink is not None:
            out_sink.close()
        dlq_sink.close()
        if index_sink is not None:
            index_sink.close()
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
    job: dict,
    position: Position,
    next_chunk: int,
    sinks: tuple[FileSink | None, FileSink, FileSink | None],
    s: BackfillSummary,
    *,
    done: bool,
) -> dict[str, Any]:
    out, dlq, index = sinks
    return {
        "version": CHECKPOINT_VERSION,
        "job": job,
        "position": position,
        "next_chunk": next_chunk,
        "output_bytes": out.tell() if out is not None else 0,
        "dlq_bytes": dlq.tell(),
        "index_bytes": index.tell() if index is not None else 0,
        "chunks": s.chunks,
        "counters": s.counters(),
        "done": done,
    }
