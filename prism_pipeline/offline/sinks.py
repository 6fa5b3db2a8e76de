"""Where an offline job's outcomes go: an append-only JSONL file that can be cut back to a
checkpointed length (gzip: one member per chunk, so a member boundary is a valid cut), or a topic
(keyed by event id; every ack awaited before the checkpoint moves).
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import structlog

from prism_pipeline.core.records import batch_headers, run_headers
from prism_pipeline.offline.errors import BackfillError
from schemas.record import record_key

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RecordLine:
    """One decision record to write, with the engine call (within its chunk) that decided it."""

    event_id: str
    value: bytes
    batch: str  # engine call within the chunk
    batch_pos: int
    batch_size: int


def fsync_dir(path: Path) -> None:
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

    async def send(self, records: list[RecordLine], chunk: int) -> None:
        base = [*run_headers(self.job_id, 1), ("prism-backfill", self.job_id.encode())]
        futs = []
        for r in records:
            # The engine call that decided it, as the worker labels it: replay re-forms these
            # batches on the reference paths, which are not batch invariant.
            headers = [*base, *batch_headers(f"{self.job_id}/{chunk}/{r.batch}", r.batch_pos, r.batch_size)]
            futs.append(
                await self._producer.send(self.topic, r.value, key=record_key(r.event_id), headers=headers)
            )
        for f in futs:
            await f
        self.sent += len(futs)

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
