"""The `prism run` worker: evidence topic -> validate -> batch -> engine thread -> decision records.

Read `run` top to bottom: start the consumer and the delivery, then two loops until a stop is asked
for — the fetch loop (poll, validate, batch, pause when the engine falls behind) and the engine loop
(the next batch to the engine thread, its records and dead letters to the delivery) — then drain
(everything consumed decided, published and committed) and close. Rebalances come in through
`_on_assigned` / `_on_revoked`. The engine runs on one dedicated thread (`core.engine_lane`), so the
event loop, and aiokafka's heartbeat on it, never block on inference.

A stop is bounded (`stop_timeout_s`): a drain that cannot finish (every broker gone, a coordinator
that moved mid-transaction, a group join that never completes) is abandoned at the deadline. That
is safe because a commit point only ever moves over acknowledged outcomes: what was not published
is not committed, and the next owner of the partition decides it again. The worker then raises
`StopAbandoned`, whose log line names what was in flight and which task was still waiting.

A revoke is bounded too: only the batch at the engine and outcomes already being published are
waited for; queued batches of a revoked partition are dropped (re-delivered, never committed), so
a revoke costs at most one engine call, and the group's join window covers it
(`WorkerSettings.rebalance_timeout_ms`).

Every consumed offset yields exactly one outcome: a decision record on the output topic or a dead
letter (`core.decide` builds them, as every other command does). How outcomes and offsets reach
Kafka — at-least-once or exactly-once — is the delivery strategy's business (`worker.delivery`).

Why one module of some 600 lines: a partition's whole life here (fetched, tracked, batched,
decided, acknowledged, revoked) is one story whose ordering rules depend on each other (register
before the first await, rewind what was fetched while changing hands, finish the engine call
before revoke); split across modules, that order would no longer be readable in one place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError

from prism_pipeline.core.batching import Batcher
from prism_pipeline.core.decide import Decided, DecisionRules, Origin, Prepared, decide_batch, prepare, settle
from prism_pipeline.core.engine_lane import EngineLane
from prism_pipeline.core.records import (
    MAX_DEAD_LETTER_ORIGINAL_BYTES,
    DecisionEngine,
    Outgoing,
    batch_headers,
    dead_letter_message,
    provenance,
    record_message,
    run_headers,
)
from prism_pipeline.worker.delivery import CLOSE_S, Partition, close_client, delivery_for, within
from prism_pipeline.worker.metrics import WorkerMetrics
from prism_pipeline.worker.settings import WorkerSettings
from prism_pipeline.worker.taskdump import task_dump
from schemas.deadletter import InvalidEvent
from schemas.record import DecisionRecord, InputRef
from schemas.systemone import Limits

log = structlog.get_logger(__name__)

_POLL_MS = 100  # longest getmany wait, so stop requests and batch deadlines are seen promptly
# After the stop deadline (or a failure), what the clients' closes still get in all: leaving the
# group and stopping the producers takes well under a second when the brokers answer.
CLOSE_GRACE_S = 5.0


class WorkerError(RuntimeError):
    """The worker could not start, or stopped because publishing failed (uncommitted input is
    re-delivered to the next worker)."""


class StopAbandoned(WorkerError):
    """The graceful stop did not finish within `stop_timeout_s`; in-flight work was abandoned
    uncommitted (`abandoned` says what: per partition the outcomes in flight and the committed
    offset, and the tasks that were still waiting)."""

    def __init__(self, abandoned: dict[str, object]) -> None:
        super().__init__(f"stop deadline passed, in-flight work abandoned: {abandoned}")
        self.abandoned = abandoned


@dataclass
class _Msg:
    """The part of a consumed Kafka message the worker keeps."""

    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int


@dataclass
class _Item:
    """A valid event travelling batcher -> engine -> delivery."""

    part: Partition
    msg: _Msg
    prepared: Prepared

    def origin(self) -> Origin:
        tp = self.part.tp
        return Origin(tp.topic, tp.partition, self.msg.offset, self.msg.key)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._worker._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._worker._on_assigned(set(assigned))


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: DecisionEngine,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.s = settings
        self.engine = engine
        self.metrics = metrics or WorkerMetrics()
        self.rules = DecisionRules(
            limits=Limits(max_questions=settings.max_questions, max_state_chars=settings.max_state_chars),
            seed_policy=settings.seed_policy,
            fixed_seed=settings.fixed_seed,
            max_gate=settings.max_gate,
        )
        self._model = provenance(engine)
        self._lane: EngineLane[_Item] = EngineLane(
            Batcher(settings.batch_tokens, settings.max_wait_ms / 1000.0, settings.max_batch_events)
        )
        self._parts: dict[TopicPartition, Partition] = {}
        self.delivery = delivery_for(
            settings, lambda: list(self._parts.values()), self._published, self._fail
        )
        self._paused = False
        self._stop = asyncio.Event()
        self._fatal: BaseException | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._stop_wait: asyncio.Future[object] | None = None  # the fetch loop's view of _stop
        self._batch_seq = 0
        self.published = 0  # outcomes acknowledged (records + dead letters)
        self.assignments = 0  # partition assignments received (a settled group stops adding)
        self.abandoned: dict[str, object] | None = None  # what a stop past its deadline left

    @property
    def assigned(self) -> list[TopicPartition]:
        """Input partitions this worker currently owns."""
        return [tp for tp, p in self._parts.items() if p.active and not p.revoking]

    def request_stop(self) -> None:
        """Stop fetching, finish and publish in-flight work, commit, return from `run` (signal-safe)."""
        if not self._stop.is_set():
            log.info("worker.stopping")
        self._stop.set()

    # ---- the worker, top to bottom ------------------------------------------------------------

    async def run(self) -> None:
        if not await self._started():
            return
        tasks = [
            asyncio.create_task(self._fetch_loop(), name="prism-fetch"),
            asyncio.create_task(self._engine_loop(), name="prism-engine"),
            asyncio.create_task(self._lag_loop(), name="prism-lag"),
            asyncio.create_task(self.delivery.background(), name="prism-delivery"),
        ]
        close_by = None
        try:
            await self._stop.wait()
            deadline = time.monotonic() + self.s.stop_timeout_s
            graceful = asyncio.create_task(self._graceful(tasks[0]), name="prism-drain")
            if not await within(graceful, deadline - time.monotonic()):
                self._abandon()
            elif not graceful.cancelled() and graceful.exception() is not None:
                raise graceful.exception()  # type: ignore[misc]
            close_by = max(deadline, time.monotonic()) if self.abandoned is None else None
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=1.0)
            # A drained worker's closes get what is left of the stop deadline (at least the
            # grace); after an abandon or a failure, the grace.
            until = (close_by or time.monotonic()) + CLOSE_GRACE_S
            await self._shutdown(until)
        if self.abandoned is not None:
            raise StopAbandoned(self.abandoned)
        if self._fatal is not None:
            raise WorkerError(f"worker failed: {type(self._fatal).__name__}: {self._fatal}") from self._fatal

    async def _started(self) -> bool:
        """Start the clients; False when a stop was asked for first (SIGTERM while connecting)."""
        start = asyncio.create_task(self._start(), name="prism-start")
        stop = asyncio.create_task(self._stop.wait(), name="prism-stop-wait")
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not start.done():
            start.cancel()
            await within(start, CLOSE_GRACE_S)
            await self._shutdown(time.monotonic() + CLOSE_GRACE_S)
            return False
        e = start.exception()
        if isinstance(e, KafkaError):
            await self._shutdown(time.monotonic() + CLOSE_GRACE_S)
            raise WorkerError(f"cannot start on Kafka at {self.s.brokers}: {type(e).__name__}: {e}") from e
        if e is not None:
            await self._shutdown(time.monotonic() + CLOSE_GRACE_S)
            raise e
        return True

    async def _graceful(self, fetch: asyncio.Task[None]) -> None:
        await fetch  # the fetch loop returns at its next poll
        if self._fatal is None:
            await self._drain()

    def _abandon(self) -> None:
        """The stop deadline passed: drop what is in flight, uncommitted, and say what it was.

        Marking every partition inactive first means no late acknowledgement can move a commit
        point any more: the committed offsets stay those of published outcomes.
        """
        parts = list(self._parts.values())
        for p in parts:
            p.active = False
        self.abandoned = {
            "stop_timeout_s": self.s.stop_timeout_s,
            "in_flight": {str(p.tp.partition): p.tracker.in_flight for p in parts if p.tracker.in_flight},
            "committed": {str(p.tp.partition): p.committed for p in parts},
            "queued_batches": self._lane.queued,
            "waiting": [t for t in task_dump() if t["task"].startswith("prism-")],
        }
        log.warning("worker.stop_abandoned", **self.abandoned)

    async def _start(self) -> None:
        s = self.s
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=s.bootstrap_servers(),
            group_id=s.group_id,
            client_id=f"prism-{s.worker_id}",
            enable_auto_commit=False,
            auto_offset_reset=s.auto_offset_reset,
            isolation_level="read_committed" if self.delivery.read_committed else "read_uncommitted",
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_ms,
            rebalance_timeout_ms=s.rebalance_timeout_ms,
            max_poll_interval_ms=s.max_poll_interval_ms,
        )
        await self.delivery.start(self._consumer)
        await self._consumer.start()
        self._consumer.subscribe([s.input_topic], listener=_Listener(self))
        if s.metrics_port is not None:
            self.metrics.serve(s.metrics_port)
        log.info(
            "worker.started",
            worker=s.worker_id,
            input=s.input_topic,
            output=s.output_topic,
            dlq=s.dlq_topic,
            group=s.group_id,
            exactly_once=s.exactly_once,
            model=self._model.name,
            model_digest=self._model.file_digest,
            precision=self._model.precision,
        )

    async def _fetch_loop(self) -> None:
        """Poll, validate, batch; pause fetching while the engine is behind."""
        assert self._consumer is not None
        try:
            while not self._stop.is_set():
                deadline = self._lane.batcher.deadline()
                left_ms = _POLL_MS if deadline is None else (deadline - time.monotonic()) * 1e3
                try:
                    fetched = await self._poll(int(max(0, min(_POLL_MS, left_ms))))
                except KafkaError as e:
                    log.warning("consumer.fetch_error", error=str(e))
                    await asyncio.sleep(0.1)
                    continue
                if fetched is None:
                    return  # stopping
                if fetched:
                    await self._ingest(fetched)
                self._lane.close_due(time.monotonic())
                self._apply_backpressure()
        except Exception as e:  # a bug here must stop the worker, not leave it hanging
            self._fail(e)
        finally:
            if self._stop_wait is not None:
                self._stop_wait.cancel()

    async def _poll(self, timeout_ms: int) -> dict[TopicPartition, list] | None:
        """`getmany`, or None as soon as a stop is asked for.

        aiokafka's `getmany` ignores its timeout while the group rebalances: it waits for the new
        assignment first, without a bound. A SIGTERM during a join that never completes (another
        member slow to rejoin, a coordinator that moved) then never reached the drain: issue #23.
        Cancelling the poll loses nothing: records it had not returned were never tracked, so
        never committed.
        """
        assert self._consumer is not None
        if self._stop_wait is None:
            self._stop_wait = asyncio.ensure_future(self._stop.wait())
        poll = asyncio.ensure_future(
            self._consumer.getmany(timeout_ms=timeout_ms, max_records=self.s.max_poll_records)
        )
        await asyncio.wait({poll, self._stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not poll.done():
            poll.cancel()
            return None
        return poll.result()

    async def _engine_loop(self) -> None:
        """The next batch to the engine thread; its records and dead letters to the delivery."""
        while True:
            batch = await self._lane.next()
            assert batch is not None
            self.metrics.queued_batches.set(self._lane.queued)
            # A revoking partition's queued events are dropped, not decided: a revoke waits for
            # one engine call at most, and they go uncommitted to the partition's next owner.
            items = [it for it in batch.items if it.part.active and not it.part.revoking]
            for it in items:
                it.part.at_engine += 1
            try:
                if items:
                    self._batch_seq += 1
                    batch_id = f"{self.s.worker_id}/{self._batch_seq}"
                    outs = await self._lane.call(self._decide, items, batch_id)
                    for it, out in zip(items, outs, strict=True):
                        await self._emit(it.part, it.msg.offset, out, it.msg.timestamp_ms)
            except Exception as e:  # a bug here must not wedge the worker silently
                self._fail(e)
            finally:
                for it in items:
                    it.part.at_engine -= 1
            if self._consumer is not None and not self._stop.is_set():
                self._apply_backpressure()

    async def _drain(self) -> None:
        """Graceful stop: everything consumed gets its outcome published and committed."""
        self._lane.flush()
        await self._wait_until(lambda: self._idle() or self._fatal is not None, timeout=None)
        await self.delivery.finish()

    async def _shutdown(self, until: float) -> None:
        """Close the clients, each at most until `until` (monotonic) and at most `CLOSE_S`."""

        def left() -> float:
            return min(CLOSE_S, max(0.1, until - time.monotonic()))

        if self._consumer is not None:
            await close_client("consumer", self._consumer.stop(), left())
        parts = list(self._parts.values())
        for p in parts:
            p.active = False
        await asyncio.gather(*(self.delivery.released(p, left()) for p in parts))
        await self.delivery.stop(left())
        if self.abandoned is None:
            self._lane.shutdown()  # waits for the engine call running now
        # else: the engine thread ends after its current call, when the process exits
        self.metrics.close()
        log.info("worker.stopped", published=self.published, abandoned=self.abandoned is not None)

    # ---- consuming ----------------------------------------------------------------------------

    async def _ingest(self, fetched: dict[TopicPartition, list]) -> None:
        msgs: list[tuple[TopicPartition, _Msg]] = [
            (tp, _Msg(m.offset, m.key, m.value if m.value is not None else b"", m.timestamp))
            for tp, ms in fetched.items()
            for m in ms
        ]
        owners = {tp: self._parts.get(tp) for tp in fetched}
        # Parsing and tokenizing are CPU work: off the loop, beside (not behind) the engine thread.
        prepared = await asyncio.to_thread(self._prepare, [m.value for _, m in msgs])
        now = time.monotonic()
        skipped: dict[TopicPartition, int] = {}
        for (tp, msg), prep in zip(msgs, prepared, strict=True):
            part = self._parts.get(tp)
            if part is None or part is not owners[tp] or not part.active or part.revoking:
                skipped.setdefault(tp, msg.offset)
                continue
            try:
                part.tracker.track(msg.offset)
            except ValueError:
                log.warning("consumer.offset_repeated", partition=tp.partition, offset=msg.offset)
                continue
            self.metrics.events_in.inc()
            if isinstance(prep, InvalidEvent):
                origin = Origin(tp.topic, tp.partition, msg.offset, msg.key)
                letter = origin.dead_letter(msg.value, prep, MAX_DEAD_LETTER_ORIGINAL_BYTES)
                log.info(
                    "event.invalid",
                    reason=str(prep.reason),
                    message=prep.message,
                    partition=tp.partition,
                    offset=msg.offset,
                )
                out = dead_letter_message(letter, self.s.dlq_topic, msg.key, run_headers(self.s.worker_id, 1))
                await self._emit(part, msg.offset, out, msg.timestamp_ms)
                continue
            self._lane.add(_Item(part, msg, prep), prep.tokens, now)
        self._rewind(skipped)

    def _rewind(self, skipped: dict[TopicPartition, int]) -> None:
        """Seek back over messages fetched while their partition was changing hands.

        Skipping them silently would move the fetch position past them; if the partition stays
        (or comes back) here, they must be read again. A partition that is gone refuses the
        seek, and its next owner starts from the committed offset anyway.
        """
        assert self._consumer is not None
        for tp, offset in skipped.items():
            try:
                self._consumer.seek(tp, offset)
            except (IllegalStateError, AssertionError, KafkaError):
                continue
            log.debug("consumer.rewind", partition=tp.partition, offset=offset)

    def _prepare(self, values: list[bytes]) -> list[Prepared | InvalidEvent]:
        return [prepare(raw, self.engine, self.rules) for raw in values]

    def _apply_backpressure(self) -> None:
        assert self._consumer is not None
        queued = self._lane.queued
        self.metrics.queued_batches.set(queued)
        if not self._paused and queued >= self.s.max_queued_batches:
            self._consumer.pause(*self._consumer.assignment())
            self._paused = True
            self.metrics.paused.set(1)
            self.metrics.pauses.inc()
            log.info("backpressure.pause", queued_batches=queued)
        elif self._paused and queued <= self.s.max_queued_batches // 2:
            self._consumer.resume(*self._consumer.assignment())
            self._paused = False
            self.metrics.paused.set(0)
            log.info("backpressure.resume", queued_batches=queued)

    # ---- the engine ---------------------------------------------------------------------------

    def _decide(self, items: list[_Item], batch_id: str) -> list[Outgoing]:
        """On the engine thread: one engine call for the batch (each event alone if it fails), then
        each event's record or dead letter."""
        tokens = sum(it.prepared.tokens for it in items)
        self.metrics.batch_events.observe(len(items))
        self.metrics.batch_tokens.observe(tokens)
        decided = decide_batch(self.engine.decide, [it.prepared.request for it in items])
        for seconds in decided.seconds if decided.alone else decided.seconds[:1]:
            self.metrics.engine_seconds.observe(seconds)
        cache = getattr(self.engine, "cache", None)
        if cache is not None:
            self.metrics.observe_cache(cache.stats)
        if not decided.alone:
            log.info(
                "batch.decided",
                events=len(items),
                tokens=tokens,
                engine_s=round(decided.seconds[0], 4),
                event_ids=[it.prepared.event.event_id for it in items],
            )
        return self._outcomes(items, decided, batch_id)

    def _outcomes(self, items: list[_Item], decided: Decided, batch_id: str) -> list[Outgoing]:
        outs: list[Outgoing] = []
        attempt = 2 if decided.alone else 1
        for pos, (it, res, seconds) in enumerate(zip(items, decided.results, decided.seconds, strict=True)):
            tp = it.part.tp
            headers = run_headers(self.s.worker_id, attempt, {"engine": seconds})
            if decided.alone:  # decided alone after its batch failed
                headers += batch_headers(f"{batch_id}/{it.msg.offset}", 0, 1)
            else:
                headers += batch_headers(batch_id, pos, len(items))
            source = InputRef(topic=tp.topic, partition=tp.partition, offset=it.msg.offset)
            done = settle(
                it.msg.value,
                it.prepared,
                res,
                self._model,
                it.origin(),
                source=source,
                max_original_bytes=MAX_DEAD_LETTER_ORIGINAL_BYTES,
            )
            if isinstance(done, DecisionRecord):
                outs.append(record_message(done, self.s.output_topic, headers))
            else:
                outs.append(dead_letter_message(done, self.s.dlq_topic, it.msg.key, headers))
        return outs

    # ---- publishing ---------------------------------------------------------------------------

    async def _emit(self, part: Partition, offset: int, out: Outgoing, timestamp_ms: int) -> None:
        if not part.active:
            return  # revoked while in flight: the next owner decides it again
        await self.delivery.publish(part, offset, out, timestamp_ms)

    def _published(self, part: Partition, offset: int, out: Outgoing, timestamp_ms: int) -> None:
        if not part.active:
            return
        part.tracker.ack(offset)
        self.published += 1
        m = self.metrics
        if out.kind == "record":
            m.records_out.inc()
            m.observe_questions(out.questions, out.thought)
            log.debug("record.published", event_id=out.event_id, partition=part.tp.partition, offset=offset)
        else:
            m.dead_letters.labels(reason=out.reason or "unknown").inc()
        if timestamp_ms > 0:
            m.end_to_end_seconds.observe(max(0.0, time.time() - timestamp_ms / 1000.0))

    # ---- rebalances ---------------------------------------------------------------------------

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        assert self._consumer is not None
        # Register every partition before the first await: the fetcher may already be returning
        # their messages to the fetch loop.
        new = [
            Partition(tp)
            for tp in sorted(assigned, key=lambda t: (t.topic, t.partition))
            if tp not in self._parts
        ]
        for part in new:
            self._parts[part.tp] = part
        if self._paused and assigned:
            self._consumer.pause(*assigned)
        for part in new:
            await self.delivery.assigned(part)
        self.assignments += 1
        log.info("partitions.assigned", partitions=sorted(tp.partition for tp in assigned))

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        parts = [p for tp, p in self._parts.items() if tp in revoked]
        if not parts:
            return
        for p in parts:
            p.revoking = True
        # Only what is at the engine or being published is waited for (the engine loop drops
        # queued events of revoking partitions): a revoke is one engine call, not a queue's worth,
        # so the member rejoins within the group's rebalance timeout and is not expelled.
        finished = await self._wait_until(
            lambda: (
                all(p.at_engine == 0 and not self.delivery.busy(p) for p in parts) or self._fatal is not None
            ),
            timeout=self.s.revoke_timeout_s,
        )
        if not finished:
            log.warning(
                "partitions.revoke_timeout",
                at_engine={p.tp.partition: p.at_engine for p in parts if p.at_engine},
            )
        await self.delivery.commit(parts)
        for p in parts:
            p.active = False
            del self._parts[p.tp]
            await self.delivery.released(p)
        log.info(
            "partitions.revoked",
            partitions=sorted(p.tp.partition for p in parts),
            # decided by the next owner: fetched here, not published
            redelivered={p.tp.partition: p.tracker.in_flight for p in parts if p.tracker.in_flight},
        )

    # ---- small parts --------------------------------------------------------------------------

    def _idle(self) -> bool:
        return self._lane.idle and all(p.tracker.in_flight == 0 for p in self._parts.values() if p.active)

    def _fail(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
            log.error("worker.failed", error=f"{type(exc).__name__}: {exc}")
        self._stop.set()

    @staticmethod
    async def _wait_until(pred: Callable[[], bool], timeout: float | None, step: float = 0.005) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not pred():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(step)
        return True

    async def _lag_loop(self) -> None:
        assert self._consumer is not None
        while True:
            await asyncio.sleep(1.0)
            for tp in list(self._parts):
                try:
                    c = self._consumer
                    high = c.last_stable_offset(tp) if self.delivery.read_committed else c.highwater(tp)
                    pos = await asyncio.wait_for(self._consumer.position(tp), 1.0)
                except (KafkaError, TimeoutError, AssertionError, KeyError):
                    continue
                if high is not None:
                    self.metrics.consumer_lag.labels(topic=tp.topic, partition=str(tp.partition)).set(
                        max(0, high - pos)
                    )
