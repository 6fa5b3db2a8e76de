"""Where an offline job's events come from, in a fixed order, with a position to resume at.

`FileSource`: JSONL files (plain or `.gz`, one event per line, blank lines ignored) in the order
given; position = (file index, line number, byte offset of the line). `TopicSource`: a fixed range
of a topic, partitions ascending, offsets ascending; the end is fixed when the job starts (and kept
in the checkpoint), so a resumed job reads exactly the same events; position = (range index,
offset).
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import structlog

from prism_pipeline.core.decide import Origin
from prism_pipeline.offline.errors import BackfillError
from prism_pipeline.offline.kafka_range import offset_bounds, stream_ranges, topic_partitions
from schemas.record import InputRef

log = structlog.get_logger(__name__)


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
        ranges: Sequence[Sequence[int]] | None = None,  # (partition, start, end) each, already fixed
    ) -> None:
        self.bootstrap = bootstrap
        self._given = None if ranges is None else [list(r) for r in ranges]
        self.topic = topic
        self.partitions = partitions
        self.from_offset = from_offset
        self.to_offset = to_offset
        self.ranges: list[tuple[int, int, int]] = []  # (partition, start, end)

    async def resolve(self, fixed: list[list[int]] | None = None) -> None:
        """Fix the range (from a checkpoint's description when resuming, else as given)."""
        fixed = fixed if fixed is not None else self._given
        if fixed is not None:
            self.ranges = [(p, s, e) for p, s, e in fixed]
            return
        existing = await topic_partitions(self.bootstrap, self.topic)
        parts = sorted(self.partitions) if self.partitions else existing
        if set(parts) - set(existing):
            raise BackfillError(f"topic {self.topic!r} has partitions {existing}, not {parts}")
        begin, end = await offset_bounds(self.bootstrap, self.topic, parts)
        self.ranges = []
        for p in parts:
            lo = max(begin[p], self.from_offset or 0)
            hi = end[p] if self.to_offset is None else min(end[p], self.to_offset)
            self.ranges.append((p, lo, max(lo, hi)))

    def describe(self) -> dict[str, Any]:
        return {"topic": self.topic, "ranges": [list(r) for r in self.ranges]}

    def total(self) -> int:
        return sum(e - s for _, s, e in self.ranges)

    async def items(self, start: Position) -> AsyncIterator[tuple[Item, Position]]:
        first = start.get("part", 0)
        ranges = [
            (part, max(lo, start.get("offset", lo)) if i == first else lo, hi)
            for i, (part, lo, hi) in enumerate(self.ranges)
        ]
        async for i, m in stream_ranges(self.bootstrap, self.topic, ranges, first):
            item = Item(m.value or b"", self.topic, m.partition, m.offset, m.key, from_topic=True)
            yield item, {"part": i, "offset": m.offset + 1}
