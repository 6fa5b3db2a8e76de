"""The asyncio side of engine batching for the HTTP server.

Requests arrive one by one on the event loop; `EngineDispatcher` groups them with the pipeline's
pure `Batcher` (token budget, max wait, max requests) and runs each closed batch as ONE
`engine.decide` call on ONE dedicated thread, so the loop keeps accepting connections while the
engine works and the engine never sees two calls at once. Each request's future gets its own
`DecideResult` back.

Dispatch rule: while the engine is busy, arrivals keep filling the open batch (up to the budget)
instead of being cut into many small batches at each deadline; when the engine is idle, the open
batch goes as soon as its oldest request has waited `max_wait_s`.

Fairness: an engine that takes `on_ready` hands each request's result over as soon as it is
final, so a short request batched with long thoughts is answered after the first read-outs, not
after the thoughts (the bits are the same: only when the answer leaves changes). An engine that
takes `between_steps` also lets short requests (`side_max_tokens`) that cannot think (every
question's gate 0 after the ceilings, or rounds of >26 options) run between two thought steps
of a long call instead of
waiting for it: the engine thread claims them from a side lane, so each runs exactly once,
either there or in its batch.

A batch that raises is retried request by request, so one request the engine cannot handle
fails alone and its companions still get answers.

Draining (SIGTERM): `begin_drain(s)` refuses new requests at once and, `s` seconds later, sets the
cancel token of every request still accepted, so the engine stops their thoughts at the next
step and the engine thread is free well within a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from engine.types import CancelToken, DecideRequest, DecideResult
from prism_pipeline.core.batching import Batch, Batcher
from prism_pipeline.core.decide import decide_batch
from prism_pipeline.core.engine_lane import EngineLane

log = structlog.get_logger(__name__)


class Decider(Protocol):
    def decide(self, requests: list[DecideRequest]) -> list[DecideResult]: ...


def _takes(engine: Decider, name: str) -> bool:
    try:
        return name in inspect.signature(engine.decide).parameters
    except (TypeError, ValueError):
        return False


class Overloaded(RuntimeError):
    """More requests are waiting than the server accepts; the client should retry later."""


class DispatcherClosed(RuntimeError):
    """The server is shutting down and takes no new requests."""


@dataclass(eq=False)
class _Pending:
    request: DecideRequest
    tokens: int
    future: asyncio.Future[DecideResult]
    enqueued: float = field(default_factory=time.monotonic)
    claimed: bool = False  # taken by an engine call (its batch, or a side run between steps)


def _never_thinks(request: DecideRequest, default_gate: float) -> bool:
    """Whether no question of `request` can think (the engine's gate rule, after the ceilings)."""
    event_gate = default_gate if request.gate is None else request.gate
    for question in request.request.questions.values():
        gate = event_gate if question.gate is None else question.gate
        if request.max_gate is not None:
            gate = min(gate, request.max_gate)
        criteria = question.criteria
        many = question.type == "choice" and isinstance(criteria, dict) and len(criteria) > 26
        if gate > 0.0 and not many:
            return False
    return True


@dataclass(frozen=True)
class BatchStats:
    """What one engine call did (reported to the metrics hook)."""

    requests: int
    tokens: int
    engine_seconds: float
    queue_seconds: list[float]  # per request: arrival to the start of its engine call
    thought_tokens: int = 0  # generated, answered or not (a cut request's thought counts too)
    stopped: dict[str, int] = field(default_factory=dict)  # requests cut, by reason (deadline, cancelled)


class EngineDispatcher:
    def __init__(
        self,
        engine: Decider,
        *,
        max_tokens: int,
        max_wait_s: float,
        max_requests: int | None = None,
        max_pending: int = 1024,
        on_batch: Callable[[BatchStats], None] | None = None,
        side_max_tokens: int = 1024,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.engine = engine
        self.max_pending = max_pending
        self._lane: EngineLane[_Pending] = EngineLane(Batcher(max_tokens, max_wait_s, max_requests))
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._pending = 0
        self._on_batch = on_batch
        self._early = _takes(engine, "on_ready")
        dc = getattr(engine, "decision_config", None)
        self._side_gate: float | None = None  # the engine's default gate, when side runs are possible
        if _takes(engine, "between_steps") and getattr(engine, "tp", None) is None and dc is not None:
            self._side_gate = float(dc.gate)
        self._side: deque[_Pending] = deque()  # requests that cannot think, claimable between steps
        self._claim = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.side_runs = 0  # engine calls made between thought steps (tests, metrics)
        # Only short work goes between steps: a long prefill there would stall the thoughts as
        # long as it stalls a short request in a batch.
        self._side_max_tokens = side_max_tokens
        self._tokens: set[CancelToken] = set()  # of the accepted requests, for the drain
        self._drain: asyncio.TimerHandle | None = None
        self._in_engine = 0

    @property
    def in_engine(self) -> int:
        """Batches in the engine now (0 or 1), counted until their stats are recorded.

        A request answered early (on_ready) reaches its client while its batch still runs, so a
        reader of the batch stats who waits for this to be 0 sees every answered request's batch.
        """
        return self._in_engine

    @property
    def draining(self) -> bool:
        return self._closing

    @property
    def pending(self) -> int:
        """Requests accepted and not yet answered (waiting or in the engine)."""
        return self._pending

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="prism-http-dispatch")

    async def stop(self) -> None:
        """Answer everything already accepted, then stop the engine thread."""
        self._closing = True
        self._lane.wake()
        if self._drain is not None:
            self._drain.cancel()
        if self._task is not None:
            await self._task
            self._task = None
        self._lane.shutdown()

    async def decide(self, request: DecideRequest, tokens: int) -> DecideResult:
        if self._closing:
            raise DispatcherClosed("the server is shutting down")
        if self._pending >= self.max_pending:
            raise Overloaded(f"{self._pending} requests are already waiting (limit {self.max_pending})")
        fut: asyncio.Future[DecideResult] = asyncio.get_running_loop().create_future()
        self._pending += 1
        if request.cancel is not None:
            self._tokens.add(request.cancel)
        try:
            pending = _Pending(request, tokens, fut)
            side = self._side_gate is not None and tokens <= self._side_max_tokens
            if side and _never_thinks(request, self._side_gate):  # type: ignore[arg-type]
                with self._claim:
                    self._side.append(pending)
            self._lane.add(pending, tokens)
            return await fut
        finally:
            self._pending -= 1
            if request.cancel is not None:
                self._tokens.discard(request.cancel)

    def begin_drain(self, drain_s: float) -> None:
        """Take no new requests; cut the accepted ones' thoughts if they still run after `drain_s`."""
        if self._closing:
            return
        log.info("serve.draining", pending=self._pending, drain_s=drain_s)
        self._closing = True
        self._lane.wake()
        self._drain = asyncio.get_running_loop().call_later(drain_s, self.cancel_all)

    def cancel_all(self) -> None:
        """Set every accepted request's cancel token: the engine stops their thoughts next step."""
        if self._tokens:
            log.info("serve.drain_cancelling", requests=len(self._tokens))
        for token in list(self._tokens):
            token.cancel()

    # ---- the dispatch loop ---------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            batch = await self._lane.next(deadlines=True, drain=lambda: self._closing)
            if batch is None:
                return
            await self._execute(batch)

    def _between_steps(self) -> None:
        """On the engine thread, between two thought steps: run the waiting requests that cannot
        think (claimed here, so their batch skips them) and hand their results to the loop."""
        with self._claim:
            side = [p for p in self._side if not p.claimed and not p.future.done()]
            for p in side:
                p.claimed = True
            self._side.clear()
        if not side or self._loop is None:
            return
        self.side_runs += 1
        try:  # nothing here may fail the long call it runs inside
            results = _decide_isolated(self.engine, [p.request for p in side])
            for p, outcome in zip(side, results, strict=True):
                self._loop.call_soon_threadsafe(_settle, p.future, outcome)
        except Exception as e:
            log.warning("serve.side_run_failed", requests=len(side), error=f"{type(e).__name__}: {e}")
            for p in side:
                with contextlib.suppress(RuntimeError):  # the loop is closing
                    self._loop.call_soon_threadsafe(_settle, p.future, e)

    async def _execute(self, batch: Batch[_Pending]) -> None:
        with self._claim:  # a cancelled client, or a request already run between steps, is skipped
            items = [p for p in batch.items if not p.future.done() and not p.claimed]
            for p in items:
                p.claimed = True
            if self._side:
                self._side = deque(p for p in self._side if not p.claimed)
        if not items:
            return
        self._in_engine += 1
        try:
            await self._run_and_record(items)
        finally:
            self._in_engine -= 1

    async def _run_and_record(self, items: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        on_ready = None
        if self._early:

            def deliver(i: int, result: DecideResult) -> None:
                if not items[i].future.done():
                    items[i].future.set_result(result)

            def on_ready(i: int, result: DecideResult) -> None:  # on the engine thread
                loop.call_soon_threadsafe(deliver, i, result)

        try:
            side = self._between_steps if self._side_gate is not None else None
            results = await self._lane.call(
                _decide_isolated, self.engine, [p.request for p in items], on_ready, side
            )
        except BaseException as e:  # the thread itself failed: every waiter learns why
            for p in items:
                if not p.future.done():
                    p.future.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        engine_seconds = time.monotonic() - started
        for p, outcome in zip(items, results, strict=True):
            if p.future.done():
                continue
            if isinstance(outcome, BaseException):
                p.future.set_exception(outcome)
            else:
                p.future.set_result(outcome)
        stopped: dict[str, int] = {}
        for outcome in results:
            if isinstance(outcome, DecideResult) and outcome.stopped is not None:
                stopped[outcome.stopped] = stopped.get(outcome.stopped, 0) + 1
        if self._on_batch is not None:
            self._on_batch(
                BatchStats(
                    requests=len(items),
                    tokens=sum(p.tokens for p in items),
                    engine_seconds=engine_seconds,
                    queue_seconds=[started - p.enqueued for p in items],
                    thought_tokens=sum(o.output_tokens for o in results if isinstance(o, DecideResult)),
                    stopped=stopped,
                )
            )


def _settle(future: asyncio.Future[DecideResult], outcome: DecideResult | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _decide_isolated(
    engine: Decider,
    requests: list[DecideRequest],
    on_ready: Callable[[int, DecideResult], None] | None = None,
    between_steps: Callable[[], None] | None = None,
) -> list[DecideResult | Exception]:
    """Runs on the engine thread: the whole batch, or, if it raises, each request on its own
    (the pipeline's one retry rule, `core.decide.decide_batch`)."""
    kw: dict[str, object] = {}
    if on_ready is not None:
        kw["on_ready"] = on_ready
    if between_steps is not None:
        kw["between_steps"] = between_steps
    return decide_batch(engine.decide, requests, **kw).results
