"""N backfill processes over one input, merged to the one output a single process writes.

Why static striping of chunks, not a consumer group: a single-process backfill cuts its input
into fixed chunks of `chunk_events` (the unit of its checkpoint and of its batching), and its
records are bit-reproducible because every resume cuts and batches exactly as before. A consumer
group assigns partitions dynamically (a rebalance moves them), so neither the chunk cuts nor the
resume point would be fixed. Instead shard K of N (1-based) decides the chunks whose global index
g has g % N == K - 1 and skips the others' events (it still reads them: reading is cheap next to
deciding, and it is how every shard finds the same chunk boundaries without a planning pass, even
on a topic whose offsets have gaps). Each chunk is then decided exactly as the single process
decides it, in the same batches; on the batch-invariant int8 path that makes the merged output
the single process's bytes whatever engine state the shard's earlier chunks left.

Each shard is a whole backfill job of its own: its own output, dead-letter file and checkpoint
(`NAME.shard-K-of-N.SUFFIX` beside the merged paths), resumable by itself exactly as a single job
is; beside its checkpoint an index file (`...checkpoint.index`, cut back on resume like the other
files) lists per chunk it wrote: the global chunk index and both files' lengths after it. The
merge copies the chunks in global order into the one output and one dead-letter file, after
checking that every shard is done, that they ran the same job and that the chunks are exactly
0..G-1, each once; it replaces the output atomically, then writes the merged checkpoint
(`"processes": N` in its job) and only then deletes the shards' data files (their checkpoints
stay, so a rerun finds every shard done and the merged checkpoint complete). A crash anywhere in
the merge leaves the shards' files and the merge is simply redone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from prism_pipeline.offline.checkpoint import CHECKPOINT_VERSION, read_checkpoint, write_checkpoint
from prism_pipeline.offline.errors import BackfillError
from prism_pipeline.offline.sinks import fsync_dir

log = structlog.get_logger(__name__)

COUNTERS = ("events", "records", "dead_letters", "questions", "thought_questions")


@dataclass(frozen=True)
class Shard:
    """Shard `number` (1-based) of `count`: the chunks g with g % count == number - 1."""

    number: int
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.number <= self.count:
            raise BackfillError(f"shard {self.number}/{self.count}: need 1 <= K <= N")

    def owns(self, chunk: int) -> bool:
        return chunk % self.count == self.number - 1

    def path(self, path: Path) -> Path:
        """This shard's file for merged `path`: records.jsonl -> records.shard-2-of-4.jsonl."""
        return path.with_name(f"{path.stem}.shard-{self.number}-of-{self.count}{path.suffix}")

    def index_path(self, checkpoint: Path) -> Path:
        cp = self.path(checkpoint)
        return cp.with_name(cp.name + ".index")

    def share(self, total: int, chunk_events: int) -> int:
        """Events of a `total`-event input this shard decides."""
        chunks = -(-total // chunk_events)
        return sum(min(chunk_events, total - g * chunk_events) for g in range(chunks) if self.owns(g))


def shards(count: int) -> list[Shard]:
    return [Shard(k, count) for k in range(1, count + 1)]


def shard_states(checkpoint: Path, count: int) -> list[dict[str, Any] | None]:
    return [read_checkpoint(s.path(checkpoint)) for s in shards(count)]


def _index(shard: Shard, checkpoint: Path, length: int) -> list[tuple[int, int, int]]:
    with shard.index_path(checkpoint).open("rb") as f:
        data = f.read(length)
    return [(int(g), int(o), int(d)) for g, o, d in (line.split() for line in data.splitlines())]


def _copy(pieces: list[tuple[Path, int, int]], target: Path) -> int:
    """Write the byte ranges in order to `target`, atomically (temporary file, fsync, rename)."""
    tmp = target.with_name(target.name + ".merging")
    target.parent.mkdir(parents=True, exist_ok=True)
    handles: dict[Path, Any] = {}
    try:
        with tmp.open("wb") as out:
            for path, lo, hi in pieces:
                if hi > lo:
                    src = handles.get(path) or handles.setdefault(path, path.open("rb"))
                    src.seek(lo)
                    out.write(src.read(hi - lo))
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
    finally:
        for h in handles.values():
            h.close()
    os.replace(tmp, target)
    fsync_dir(target)
    return size


def merge_shards(output: Path | None, dlq: Path, checkpoint: Path, count: int) -> tuple[dict[str, Any], bool]:
    """Merge the N finished shards into `output` (None: records went to a topic) and `dlq`.

    Returns the merged checkpoint state and whether it was already merged (nothing done)."""
    states = shard_states(checkpoint, count)
    unfinished = [
        f"{s.number}/{count}" for s, st in zip(shards(count), states, strict=True) if not st or not st["done"]
    ]
    if unfinished:
        raise BackfillError(
            f"shard(s) {', '.join(unfinished)} not finished; rerun the same command to resume them"
        )
    done: list[dict[str, Any]] = [st for st in states if st is not None]
    jobs = [{k: v for k, v in st["job"].items() if k != "shard"} for st in done]
    for s, j in zip(shards(count), jobs, strict=True):
        diff = sorted(k for k in set(j) | set(jobs[0]) if j.get(k) != jobs[0].get(k))
        if diff:
            raise BackfillError(f"shard {s.number}/{count} ran another job (differs in: {', '.join(diff)})")
    job = {**jobs[0], "processes": count}
    merged = read_checkpoint(checkpoint)
    if merged is not None:
        if merged["job"] != job:
            raise BackfillError(f"checkpoint {checkpoint} belongs to another job; delete it to start over")
        if merged["done"]:
            return merged, True

    entries: list[tuple[int, Shard, int, int, int, int]] = []
    for s, st in zip(shards(count), done, strict=True):
        prev_out = prev_dlq = 0
        rows = _index(s, checkpoint, st["index_bytes"])
        for g, out_end, dlq_end in rows:
            entries.append((g, s, prev_out, out_end, prev_dlq, dlq_end))
            prev_out, prev_dlq = out_end, dlq_end
        if (prev_out, prev_dlq) != (st["output_bytes"], st["dlq_bytes"]) or len(rows) != st["chunks"]:
            raise BackfillError(f"shard {s.number}/{count}: its index disagrees with its checkpoint")
    entries.sort(key=lambda e: e[0])
    if [e[0] for e in entries] != list(range(len(entries))):
        raise BackfillError(
            "the shards' chunks have a gap or an overlap; delete the checkpoints to start over"
        )
    out_bytes = 0
    if output is not None:
        out_bytes = _copy([(s.path(output), lo, hi) for _, s, lo, hi, _, _ in entries], output)
    dlq_bytes = _copy([(s.path(dlq), lo, hi) for _, s, _, _, lo, hi in entries], dlq)
    counters: dict[str, Any] = {k: sum(st["counters"][k] for st in done) for k in COUNTERS}
    reasons: dict[str, int] = {}
    for st in done:
        for r, n in st["counters"]["dead_letter_reasons"].items():
            reasons[r] = reasons.get(r, 0) + n
    counters["dead_letter_reasons"] = dict(sorted(reasons.items()))
    state = {
        "version": CHECKPOINT_VERSION,
        "job": job,
        "position": {},
        "output_bytes": out_bytes,
        "dlq_bytes": dlq_bytes,
        "chunks": len(entries),
        "next_chunk": len(entries),
        "counters": counters,
        "done": True,
    }
    write_checkpoint(checkpoint, state)
    for s in shards(count):
        for p in (*([s.path(output)] if output is not None else []), s.path(dlq), s.index_path(checkpoint)):
            p.unlink(missing_ok=True)
    log.info("backfill.merged", processes=count, chunks=len(entries), events=counters["events"])
    return state, False
