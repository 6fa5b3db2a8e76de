"""The one way to the engine: batches waiting in order, and the one thread that runs them.

Inference never runs on the event loop (aiokafka's heartbeat and the HTTP server's connections
live there), and the engine never sees two calls at once. The Kafka worker and the HTTP
dispatcher both put their work in an `EngineLane`: items go into the lane's `Batcher` (token
budget, max wait, max items), closed batches wait in order, and `next` hands the engine loop the
next one. `call` runs a function on the engine thread.

Who watches the open batch's deadline differs, on purpose: the HTTP dispatcher lets `next` close
the open batch when its oldest request has waited long enough and the engine is free (while the
engine is busy, arrivals keep filling it); the worker closes due batches from its fetch loop
(`close_due`), so a closed batch counts toward backpressure at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from prism_pipeline.core.batching import Batch, Batcher

T = TypeVar("T")
R = TypeVar("R")


class EngineLane(Generic[T]):
    def __init__(self, batcher: Batcher[T]) -> None:
        self.batcher = batcher
        self._ready: deque[Batch[T]] = deque()
        self._wake = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prism-engine")
        self.busy = False  # an engine call is running

    @property
    def queued(self) -> int:
        """Closed batches waiting for the engine."""
        return len(self._ready)

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs."""
        return not self._ready and not self.busy and self.batcher.pending_items == 0

    def add(self, item: T, tokens: int, now: float | None = None) -> None:
        """Add one item to the open batch (closing it, and maybe the next, when full)."""
        now = time.monotonic() if now is None else now
        self._push(*self.batcher.add(item, tokens, now))
        self._wake.set()  # a waiting `next` learns the open batch's deadline

    def close_due(self, now: float) -> None:
        """Close the open batch if its oldest item has waited `max_wait_s`."""
        self._push(self.batcher.due(now))

    def flush(self) -> None:
        """Close the open batch now (shutdown, rebalance)."""
        self._push(self.batcher.flush())

    def wake(self) -> None:
        """Make a waiting `next` look again (its `drain` condition may have changed)."""
        self._wake.set()

    def _push(self, *batches: Batch[T] | None) -> None:
        for batch in batches:
            if batch is not None and batch.items:
                self._ready.append(batch)
                self._wake.set()

    async def next(
        self, *, deadlines: bool = False, drain: Callable[[], bool] = lambda: False
    ) -> Batch[T] | None:
        """The next batch for the engine, waiting for one.

        `deadlines`: also close the open batch here once it is due. `drain()` true: close the open
        batch at once, and return None when nothing is left.
        """
        while True:
            if self._ready:
                return self._ready.popleft()
            if drain():
                return self.batcher.flush()
            if deadlines:
                due = self.batcher.due(time.monotonic())
                if due is not None:
                    return due
            deadline = self.batcher.deadline() if deadlines else None
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def call(self, fn: Callable[..., R], *args: Any) -> R:
        """`fn(*args)` on the engine thread."""
        self.busy = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.busy = False

    def shutdown(self) -> None:
        """Wait for the running call, then stop the engine thread."""
        self._pool.shutdown(wait=True)
