"""Progress of an offline job: one `\r`-rewritten line on a terminal, else periodic log lines."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog

log = structlog.get_logger(__name__)


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
