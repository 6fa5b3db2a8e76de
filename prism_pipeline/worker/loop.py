"""The `prism run` worker: evidence topic -> validate -> batch -> engine thread -> decision records.

One asyncio loop runs the consumer, the producer(s), the batcher and the commits; the engine runs on
one dedicated thread, so the loop (and aiokafka's heartbeat on it) never blocks on inference.

Every consumed offset yields exactly one outcome: a decision record on the output topic or a dead
letter. A partition's offset is committed only up to the first offset whose outcome is not yet
acknowledged (`OffsetTracker`), so a crash re-delivers, never skips. Delivery modes:
- at-least-once (default): outcomes are sent as soon as they exist; offsets are committed every
  `commit_interval_ms`, on revoke and on shutdown. Redelivered events produce byte-identical values
  under the same key (records are pure functions of the event), so a compacted topic keeps one.
- exactly-once (`--exactly-once`): one transactional producer per input partition (transactional id
  `{prefix}-{topic}-{partition}`: aiokafka has no KIP-447 group-metadata fencing, so zombies are
  fenced by the stable per-partition id). Outcomes are published in offset order, each run of them
  in one transaction together with its offset commit (`send_offsets_to_transaction`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError, KafkaError

from prism_pipeline.core.batching import Batch, Batcher
from prism_pipeline.core.decide import Decided, DecisionRules, Origin, Prepared, decide_batch, prepare, settle
from prism_pipeline.core.records import (
    MAX_DEAD_LETTER_ORIGINAL_BYTES,
    DecisionEngine,
    Outgoing,
    dead_letter_message,
    provenance,
    record_message,
    run_headers,
)
from prism_pipeline.worker.metrics import WorkerMetrics
from prism_pipeline.worker.offsets import OffsetTracker
from prism_pipeline.worker.settings import WorkerSettings
from schemas.deadletter import InvalidEvent
from schemas.record import DecisionRecord, InputRef
from schemas.systemone import Limits

log = structlog.get_logger(__name__)

_POLL_MS = 100  # longest getmany wait, so stop requests and batch deadlines are seen promptly
# Longest wait at shutdown for the final commit, then for each client to close: a client
# stuck in a broker round trip must not keep a drained worker from exiting.
_CLOSE_S = 20.0


class WorkerError(RuntimeError):
    """The worker could not start, or stopped because publishing failed (uncommitted input is
    re-delivered to the next worker)."""


@dataclass
class _Msg:
    """The part of a consumed Kafka message the worker keeps."""

    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int


class _Partition:
    """Per assigned input partition: its offset tracker and (exactly-once) its producer."""

    def __init__(self, tp: TopicPartition) -> None:
        self.tp = tp
        self.tracker = OffsetTracker()
        self.active = True  # False once revoked: late outcomes are dropped, never committed
        self.revoking = False  # new messages are ignored (re-delivered to the next owner)
        self.committed: int | None = None
        self.ready: dict[int, tuple[Outgoing, int]] = {}  # exactly-once: outcome + input timestamp
        self.producer: AIOKafkaProducer | None = None
        self.txn_task: asyncio.Task[None] | None = None


@dataclass
class _Item:
    """A valid event travelling batcher -> engine -> producer."""

    part: _Partition
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
        self._batcher: Batcher[_Item] = Batcher(
            settings.batch_tokens, settings.max_wait_ms / 1000.0, settings.max_batch_events
        )
        self._queue: deque[Batch[_Item]] = deque()
        self._queue_changed = asyncio.Event()
        self._engine_busy = False
        self._engine_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prism-engine")
        self._parts: dict[TopicPartition, _Partition] = {}
        self._paused = False
        self._stop = asyncio.Event()
        self._fatal: BaseException | None = None
        self._commit_lock = asyncio.Lock()
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None  # at-least-once only
        self._batch_seq = 0
        self.published = 0  # outcomes acknowledged (records + dead letters)

    @property
    def assigned(self) -> list[TopicPartition]:
        """Input partitions this worker currently owns."""
        return [tp for tp, p in self._parts.items() if p.active and not p.revoking]

    # ---- lifecycle ----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop fetching, finish and publish in-flight work, commit, return from `run` (signal-safe)."""
        if not self._stop.is_set():
            log.info("worker.stopping")
        self._stop.set()

    async def run(self) -> None:
        try:
            await self._start()
        except KafkaError as e:
            await self._shutdown()
            raise WorkerError(f"cannot start on Kafka at {self.s.brokers}: {type(e).__name__}: {e}") from e
        tasks = [
            asyncio.create_task(self._fetch_loop(), name="prism-fetch"),
            asyncio.create_task(self._engine_loop(), name="prism-engine"),
            asyncio.create_task(self._lag_loop(), name="prism-lag"),
        ]
        if not self.s.exactly_once:
            tasks.append(asyncio.create_task(self._commit_loop(), name="prism-commit"))
        try:
            await self._stop.wait()
            await tasks[0]  # the fetch loop returns at its next poll
            if self._fatal is None:
                await self._drain()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._shutdown()
        if self._fatal is not None:
            raise WorkerError(f"worker failed: {type(self._fatal).__name__}: {self._fatal}") from self._fatal

    async def _start(self) -> None:
        s = self.s
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=s.bootstrap_servers(),
            group_id=s.group_id,
            client_id=f"prism-{s.worker_id}",
            enable_auto_commit=False,
            auto_offset_reset=s.auto_offset_reset,
            isolation_level="read_committed" if s.exactly_once else "read_uncommitted",
            session_timeout_ms=s.session_timeout_ms,
            max_poll_interval_ms=s.max_poll_interval_ms,
        )
        if not s.exactly_once:
            self._producer = AIOKafkaProducer(
                bootstrap_servers=s.bootstrap_servers(), client_id=f"prism-{s.worker_id}", acks="all"
            )
            await self._producer.start()
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

    async def _drain(self) -> None:
        """Graceful stop: everything consumed gets its outcome published and committed."""
        self._dispatch(self._batcher.flush())
        await self._wait_until(lambda: self._idle() or self._fatal is not None, timeout=None)
        if not self.s.exactly_once:
            try:
                await asyncio.wait_for(self._commit(), _CLOSE_S)
            except TimeoutError:
                # Published but not committed: a restart decides them again, to the same bytes.
                log.warning("offsets.final_commit_timeout", seconds=_CLOSE_S)
        else:
            await self._wait_until(
                lambda: all(p.txn_task is None or p.txn_task.done() for p in self._parts.values()),
                timeout=None,
            )

    def _idle(self) -> bool:
        return (
            not self._queue
            and not self._engine_busy
            and self._batcher.pending_items == 0
            and all(p.tracker.in_flight == 0 for p in self._parts.values() if p.active)
        )

    async def _shutdown(self) -> None:
        if self._consumer is not None:
            await _close("consumer", self._consumer.stop())
        if self._producer is not None:
            await _close("producer", self._producer.stop())
        for p in self._parts.values():
            await self._close_partition(p)
        self._engine_pool.shutdown(wait=True)
        self.metrics.close()
        log.info("worker.stopped", published=self.published)

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

    # ---- consuming ----------------------------------------------------------------------------

    async def _fetch_loop(self) -> None:
        try:
            await self._fetch()
        except Exception as e:  # a bug here must stop the worker, not leave it hanging
            self._fail(e)

    async def _fetch(self) -> None:
        assert self._consumer is not None
        while not self._stop.is_set():
            deadline = self._batcher.deadline()
            wait_ms = (
                _POLL_MS if deadline is None else max(0, min(_POLL_MS, (deadline - time.monotonic()) * 1e3))
            )
            try:
                fetched = await self._consumer.getmany(
                    timeout_ms=int(wait_ms), max_records=self.s.max_poll_records
                )
            except KafkaError as e:
                log.warning("consumer.fetch_error", error=str(e))
                await asyncio.sleep(0.1)
                continue
            if fetched:
                await self._ingest(fetched)
            self._dispatch(self._batcher.due(time.monotonic()))
            self._apply_backpressure()

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
            item = _Item(part, msg, prep)
            for batch in self._batcher.add(item, prep.tokens, now):
                self._dispatch(batch)
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

    def _dispatch(self, batch: Batch[_Item] | None) -> None:
        if batch is None or not batch.items:
            return
        self._queue.append(batch)
        self._queue_changed.set()
        self.metrics.queued_batches.set(len(self._queue))

    def _apply_backpressure(self) -> None:
        assert self._consumer is not None
        queued = len(self._queue)
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

    async def _engine_loop(self) -> None:
        while True:
            while not self._queue:
                self._queue_changed.clear()
                await self._queue_changed.wait()
            batch = self._queue.popleft()
            self.metrics.queued_batches.set(len(self._queue))
            self._engine_busy = True
            try:
                items = [it for it in batch.items if it.part.active]
                if items:
                    await self._run_batch(items)
            except Exception as e:  # a bug here must not wedge the worker silently
                self._fail(e)
            finally:
                self._engine_busy = False
            if self._consumer is not None and not self._stop.is_set():
                self._apply_backpressure()

    async def _run_batch(self, items: list[_Item]) -> None:
        tokens = sum(it.prepared.tokens for it in items)
        self.metrics.batch_events.observe(len(items))
        self.metrics.batch_tokens.observe(tokens)
        requests = [it.prepared.request for it in items]
        loop = asyncio.get_running_loop()
        decided = await loop.run_in_executor(self._engine_pool, decide_batch, self.engine.decide, requests)
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
        self._batch_seq += 1
        outs = await asyncio.to_thread(
            self._outcomes, items, decided, f"{self.s.worker_id}/{self._batch_seq}"
        )
        for it, out in zip(items, outs, strict=True):
            await self._emit(it.part, it.msg.offset, out, it.msg.timestamp_ms)

    def _outcomes(self, items: list[_Item], decided: Decided, batch_id: str) -> list[Outgoing]:
        outs: list[Outgoing] = []
        attempt = 2 if decided.alone else 1
        for pos, (it, res, seconds) in enumerate(zip(items, decided.results, decided.seconds, strict=True)):
            tp = it.part.tp
            headers = run_headers(self.s.worker_id, attempt, {"engine": seconds})
            # Which engine call decided it, with whom: replays of a path that is not batch
            # invariant (fp32/bf16) must re-form the same batches to compare bytes.
            if decided.alone:  # decided alone after its batch failed
                batch, pos_in, size = f"{batch_id}/{it.msg.offset}", 0, 1
            else:
                batch, pos_in, size = batch_id, pos, len(items)
            headers += [
                ("prism-batch", batch.encode()),
                ("prism-batch-pos", str(pos_in).encode()),
                ("prism-batch-events", str(size).encode()),
            ]
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

    async def _emit(self, part: _Partition, offset: int, out: Outgoing, timestamp_ms: int) -> None:
        if not part.active:
            return  # revoked while in flight: the next owner decides it again
        if self.s.exactly_once:
            part.ready[offset] = (out, timestamp_ms)
            self._schedule_txn(part)
            return
        assert self._producer is not None
        try:
            fut = await self._producer.send(out.topic, out.value, key=out.key, headers=out.headers)
        except Exception as e:
            self._fail(e)
            return
        fut.add_done_callback(lambda f: self._delivered(part, offset, out, timestamp_ms, f))

    def _delivered(
        self, part: _Partition, offset: int, out: Outgoing, timestamp_ms: int, fut: asyncio.Future
    ) -> None:
        if fut.cancelled():
            self._fail(asyncio.CancelledError("send cancelled"))
            return
        if fut.exception() is not None:
            self._fail(fut.exception())  # type: ignore[arg-type]
            return
        self._acked(part, offset, out, timestamp_ms)

    def _acked(self, part: _Partition, offset: int, out: Outgoing, timestamp_ms: int) -> None:
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

    def _schedule_txn(self, part: _Partition) -> None:
        if part.producer is not None and (part.txn_task is None or part.txn_task.done()):
            part.txn_task = asyncio.create_task(self._txn_loop(part))

    async def _txn_loop(self, part: _Partition) -> None:
        """Exactly-once: publish ready outcomes in offset order, one transaction per contiguous run."""
        while part.active and part.producer is not None:
            run: list[int] = []
            for off in part.tracker.pending_in_order():
                if off not in part.ready:
                    break
                run.append(off)
            if not run:
                return
            producer = part.producer
            try:
                async with producer.transaction():
                    for off in run:
                        out = part.ready[off][0]
                        await producer.send(out.topic, out.value, key=out.key, headers=out.headers)
                    await producer.send_offsets_to_transaction({part.tp: run[-1] + 1}, self.s.group_id)
            except Exception as e:
                if part.active:
                    self._fail(e)
                return
            part.committed = run[-1] + 1
            for off in run:
                out, ts = part.ready.pop(off)
                self._acked(part, off, out, ts)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.commit_interval_ms / 1000.0)
            await self._commit()

    async def _commit(self, parts: Iterable[_Partition] | None = None) -> None:
        assert self._consumer is not None
        async with self._commit_lock:
            offsets: dict[TopicPartition, int] = {}
            for p in self._parts.values() if parts is None else parts:
                c = p.tracker.committable
                if p.active and c is not None and c != p.committed:
                    offsets[p.tp] = c
            if not offsets:
                return
            try:
                await self._consumer.commit(offsets)
            except KafkaError as e:
                # The group moved on (rebalance): the new owner re-decides from the last commit.
                log.warning("offsets.commit_failed", error=f"{type(e).__name__}: {e}")
                return
            for tp, c in offsets.items():
                p = self._parts.get(tp)
                if p is not None:
                    p.committed = c
            log.debug(
                "offsets.committed", offsets={f"{tp.topic}/{tp.partition}": c for tp, c in offsets.items()}
            )

    # ---- rebalances ---------------------------------------------------------------------------

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        assert self._consumer is not None
        # Register every partition before the first await: the fetcher may already be returning
        # their messages to the fetch loop.
        new = [
            _Partition(tp)
            for tp in sorted(assigned, key=lambda t: (t.topic, t.partition))
            if tp not in self._parts
        ]
        for part in new:
            self._parts[part.tp] = part
        if self._paused and assigned:
            self._consumer.pause(*assigned)
        if self.s.exactly_once:
            for part in new:
                # Starting a producer with this id fences any zombie still holding the partition.
                producer = AIOKafkaProducer(
                    bootstrap_servers=self.s.bootstrap_servers(),
                    client_id=f"prism-{self.s.worker_id}-{part.tp.partition}",
                    transactional_id=f"{self.s.transactional_id_prefix}-{part.tp.topic}-{part.tp.partition}",
                    acks="all",
                )
                await producer.start()
                part.producer = producer
                if part.ready:
                    self._schedule_txn(part)
        log.info("partitions.assigned", partitions=sorted(tp.partition for tp in assigned))

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        parts = [p for tp, p in self._parts.items() if tp in revoked]
        if not parts:
            return
        for p in parts:
            p.revoking = True
        # Whatever waits for a batch goes to the engine now instead of after max_wait.
        self._dispatch(self._batcher.flush())
        finished = await self._wait_until(
            lambda: all(p.tracker.in_flight == 0 for p in parts) or self._fatal is not None,
            timeout=self.s.revoke_timeout_s,
        )
        if not finished:
            log.warning(
                "partitions.revoke_timeout",
                dropped={p.tp.partition: p.tracker.in_flight for p in parts if p.tracker.in_flight},
            )
        if not self.s.exactly_once:
            await self._commit(parts)
        for p in parts:
            p.active = False
            del self._parts[p.tp]
            await self._close_partition(p)
        log.info("partitions.revoked", partitions=sorted(p.tp.partition for p in parts))

    async def _close_partition(self, part: _Partition) -> None:
        part.active = False
        if part.txn_task is not None and not part.txn_task.done():
            part.txn_task.cancel()
            with contextlib.suppress(BaseException):
                await part.txn_task
        if part.producer is not None:
            await _close("transactional_producer", part.producer.stop())
            part.producer = None

    # ---- lag ----------------------------------------------------------------------------------

    async def _lag_loop(self) -> None:
        assert self._consumer is not None
        while True:
            await asyncio.sleep(1.0)
            for tp in list(self._parts):
                try:
                    high = (
                        self._consumer.last_stable_offset(tp)
                        if self.s.exactly_once
                        else self._consumer.highwater(tp)
                    )
                    pos = await asyncio.wait_for(self._consumer.position(tp), 1.0)
                except (KafkaError, TimeoutError, AssertionError, KeyError):
                    continue
                if high is not None:
                    self.metrics.consumer_lag.labels(topic=tp.topic, partition=str(tp.partition)).set(
                        max(0, high - pos)
                    )


async def _close(what: str, stopping: Awaitable[None]) -> None:
    """Await a Kafka client's stop, at most `_CLOSE_S`; a failure or a timeout is logged, not raised."""
    try:
        await asyncio.wait_for(stopping, _CLOSE_S)
    except TimeoutError:
        log.warning("worker.close_timeout", client=what, seconds=_CLOSE_S)
    except Exception as e:
        log.warning("worker.close_failed", client=what, error=f"{type(e).__name__}: {e}")
