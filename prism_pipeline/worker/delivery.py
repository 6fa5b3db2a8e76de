"""How the worker's outcomes reach Kafka and its offsets get committed: two delivery strategies
behind one small interface, so the worker itself has no delivery branches.

Every consumed offset yields exactly one outcome (a record or a dead letter). A partition's offset
is committed only up to the first offset whose outcome is not yet acknowledged (`OffsetTracker`),
so a crash re-delivers, never skips.

- `AtLeastOnce` (default): one producer; outcomes are sent as soon as they exist; offsets are
  committed every `commit_interval_ms`, on revoke and on shutdown. A redelivered event produces a
  byte-identical value under the same key (records are pure functions of the event), so a
  compacted topic keeps one.
- `ExactlyOnce` (`--exactly-once`): one transactional producer per input partition (transactional
  id `{prefix}-{topic}-{partition}`: aiokafka has no KIP-447 group-metadata fencing, so zombies are
  fenced by the stable per-partition id). Outcomes are published in offset order, each contiguous
  run of them in one transaction together with its offset commit (`send_offsets_to_transaction`);
  the consumer reads `read_committed`.

The worker calls, in a partition's life: `assigned`, then `publish` for each outcome, `commit`
when it is revoked, `released`; at shutdown `finish` (everything published and committed), then
`stop`. `Published` is the worker's hook for an acknowledged outcome. `busy(part)` says whether
outcomes of the partition are still on their way (a revoke waits for that, not for queued work).

Every wait on a broker here is bounded (`within`, `close_client`): a stop must end even when the
brokers are gone or a coordinator moved mid-transaction (issue #23).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from prism_pipeline.core.records import Outgoing
from prism_pipeline.worker.offsets import OffsetTracker
from prism_pipeline.worker.settings import WorkerSettings

log = structlog.get_logger(__name__)

# Longest wait at shutdown for the final commit, then for each client to close: a client
# stuck in a broker round trip must not keep a drained worker from exiting.
CLOSE_S = 20.0
# Bytes of one producer batch. aiokafka sends one batch per partition per request and one request
# per broker at a time, so a partition moves at most a batch per round trip: at its 16 KiB default
# that is ~5 records of ~3 KB, and the output partition capped the worker near 1,000 records/s
# (ops/bench/bench_pipeline.py). Linger stays 0, so a lone record still goes at once.
BATCH_BYTES = 512 * 1024


async def within(task: asyncio.Future[Any], timeout: float) -> bool:
    """Wait at most `timeout` s for `task`; if it is not done then, cancel it and return False
    without waiting for the cancellation.

    `asyncio.wait_for` waits for a cancelled task to finish, and a client coroutine that catches
    the cancellation (aiokafka's coordinator close awaits its join) keeps it waiting: a bound
    that does not bound. A task left behind here is cancelled again when the loop closes.
    """
    done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout))
    if not done:
        task.cancel()
        return False
    return True


class Partition:
    """Per assigned input partition: which offsets have their outcome acknowledged."""

    def __init__(self, tp: TopicPartition) -> None:
        self.tp = tp
        self.tracker = OffsetTracker()
        self.active = True  # False once revoked: late outcomes are dropped, never committed
        self.revoking = False  # new messages are ignored (re-delivered to the next owner)
        self.committed: int | None = None
        self.at_engine = 0  # its events in the engine call now running
        self.sending = 0  # at-least-once: outcomes sent and not yet acknowledged


Published = Callable[[Partition, int, Outgoing, int], None]  # (partition, offset, outcome, input ts)
Fail = Callable[[BaseException], None]


class Delivery:
    """The interface; see the module docstring for when each is called."""

    read_committed = False  # the consumer's isolation level

    def __init__(
        self,
        settings: WorkerSettings,
        parts: Callable[[], Iterable[Partition]],
        published: Published,
        fail: Fail,
    ) -> None:
        self.s = settings
        self._parts = parts  # the partitions the worker owns now
        self._published = published
        self._fail = fail
        self._setup()

    def _setup(self) -> None:
        """The strategy's own state."""

    async def start(self, consumer: AIOKafkaConsumer) -> None: ...

    async def background(self) -> None:
        """What runs beside the worker's loops until they are cancelled (at-least-once: commits)."""

    async def assigned(self, part: Partition) -> None: ...

    async def publish(self, part: Partition, offset: int, out: Outgoing, timestamp_ms: int) -> None:
        raise NotImplementedError

    def busy(self, part: Partition) -> bool:
        """Outcomes of `part` handed in are still being published."""
        return False

    async def commit(self, parts: Iterable[Partition]) -> None: ...

    async def finish(self) -> None: ...

    async def released(self, part: Partition, timeout: float = CLOSE_S) -> None: ...

    async def stop(self, timeout: float = CLOSE_S) -> None: ...


class AtLeastOnce(Delivery):
    def _setup(self) -> None:
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._commit_lock = asyncio.Lock()

    async def start(self, consumer: AIOKafkaConsumer) -> None:
        self._consumer = consumer
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.s.bootstrap_servers(),
            client_id=f"prism-{self.s.worker_id}",
            acks="all",
            max_batch_size=BATCH_BYTES,
        )
        await self._producer.start()

    async def background(self) -> None:
        while True:
            await asyncio.sleep(self.s.commit_interval_ms / 1000.0)
            await self.commit(self._parts())

    async def publish(self, part: Partition, offset: int, out: Outgoing, timestamp_ms: int) -> None:
        assert self._producer is not None
        part.sending += 1
        try:
            fut = await self._producer.send(out.topic, out.value, key=out.key, headers=out.headers)
        except Exception as e:
            part.sending -= 1
            self._fail(e)
            return
        fut.add_done_callback(lambda f: self._delivered(part, offset, out, timestamp_ms, f))

    def busy(self, part: Partition) -> bool:
        return part.sending > 0

    def _delivered(
        self, part: Partition, offset: int, out: Outgoing, timestamp_ms: int, fut: asyncio.Future
    ) -> None:
        part.sending -= 1
        if fut.cancelled():
            self._fail(asyncio.CancelledError("send cancelled"))
            return
        if fut.exception() is not None:
            self._fail(fut.exception())  # type: ignore[arg-type]
            return
        self._published(part, offset, out, timestamp_ms)

    async def commit(self, parts: Iterable[Partition]) -> None:
        assert self._consumer is not None
        async with self._commit_lock:
            offsets: dict[TopicPartition, int] = {}
            by_tp: dict[TopicPartition, Partition] = {}
            for p in parts:
                c = p.tracker.committable
                if p.active and c is not None and c != p.committed:
                    offsets[p.tp] = c
                    by_tp[p.tp] = p
            if not offsets:
                return
            try:
                await self._consumer.commit(offsets)
            except KafkaError as e:
                # The group moved on (rebalance): the new owner re-decides from the last commit.
                log.warning("offsets.commit_failed", error=f"{type(e).__name__}: {e}")
                return
            for tp, c in offsets.items():
                by_tp[tp].committed = c
            log.debug(
                "offsets.committed", offsets={f"{tp.topic}/{tp.partition}": c for tp, c in offsets.items()}
            )

    async def finish(self) -> None:
        try:
            await asyncio.wait_for(self.commit(self._parts()), CLOSE_S)
        except TimeoutError:
            # Published but not committed: a restart decides them again, to the same bytes.
            log.warning("offsets.final_commit_timeout", seconds=CLOSE_S)

    async def stop(self, timeout: float = CLOSE_S) -> None:
        if self._producer is not None:
            await close_client("producer", self._producer.stop(), timeout)


@dataclass
class _Txn:
    """Exactly-once, per partition: its producer, the outcomes waiting for their turn, the publisher."""

    producer: AIOKafkaProducer
    ready: dict[int, tuple[Outgoing, int]] = field(default_factory=dict)  # offset -> outcome, input ts
    task: asyncio.Task[None] | None = None


class ExactlyOnce(Delivery):
    read_committed = True

    def _setup(self) -> None:
        self._txns: dict[TopicPartition, _Txn] = {}
        self._early: dict[TopicPartition, dict[int, tuple[Outgoing, int]]] = {}  # before the producer

    async def assigned(self, part: Partition) -> None:
        # Starting a producer with this id fences any zombie still holding the partition.
        tp = part.tp
        producer = AIOKafkaProducer(
            bootstrap_servers=self.s.bootstrap_servers(),
            client_id=f"prism-{self.s.worker_id}-{tp.partition}",
            transactional_id=f"{self.s.transactional_id_prefix}-{tp.topic}-{tp.partition}",
            acks="all",
            max_batch_size=BATCH_BYTES,
        )
        await producer.start()
        txn = self._txns[tp] = _Txn(producer, self._early.pop(tp, {}))
        if txn.ready:
            self._schedule(part, txn)

    async def publish(self, part: Partition, offset: int, out: Outgoing, timestamp_ms: int) -> None:
        txn = self._txns.get(part.tp)
        if txn is None:  # outcomes of a dead letter may come before the producer has started
            self._early.setdefault(part.tp, {})[offset] = (out, timestamp_ms)
            return
        txn.ready[offset] = (out, timestamp_ms)
        self._schedule(part, txn)

    def _schedule(self, part: Partition, txn: _Txn) -> None:
        if txn.task is None or txn.task.done():
            txn.task = asyncio.create_task(
                self._publish_runs(part, txn), name=f"prism-txn-{part.tp.partition}"
            )

    def busy(self, part: Partition) -> bool:
        # Outcomes behind a gap (an offset whose event was dropped at revoke) are not: they can
        # never be published in order, and go uncommitted to the next owner.
        txn = self._txns.get(part.tp)
        return txn is not None and txn.task is not None and not txn.task.done()

    async def _publish_runs(self, part: Partition, txn: _Txn) -> None:
        """Publish ready outcomes in offset order, one transaction per contiguous run."""
        while part.active and self._txns.get(part.tp) is txn:
            run: list[int] = []
            for off in part.tracker.pending_in_order():
                if off not in txn.ready:
                    break
                run.append(off)
            if not run:
                return
            try:
                async with txn.producer.transaction():
                    for off in run:
                        out = txn.ready[off][0]
                        await txn.producer.send(out.topic, out.value, key=out.key, headers=out.headers)
                    await txn.producer.send_offsets_to_transaction({part.tp: run[-1] + 1}, self.s.group_id)
            except Exception as e:
                if part.active:
                    self._fail(e)
                return
            part.committed = run[-1] + 1
            for off in run:
                out, ts = txn.ready.pop(off)
                self._published(part, off, out, ts)

    async def finish(self) -> None:
        while not all(t.task is None or t.task.done() for t in self._txns.values()):
            await asyncio.sleep(0.005)

    async def released(self, part: Partition, timeout: float = CLOSE_S) -> None:
        """Stop the partition's producer. A transaction cut off here is all or nothing: its
        records and its offsets commit together (if the commit request already went out) or not at
        all (the broker aborts it when the next owner's producer with the same transactional id
        starts, or at its transaction timeout), so read_committed readers never see records whose
        offsets stay uncommitted."""
        self._early.pop(part.tp, None)
        txn = self._txns.pop(part.tp, None)
        if txn is None:
            return
        if txn.task is not None and not txn.task.done():
            txn.task.cancel()
            await within(txn.task, timeout)
        await close_client("transactional_producer", txn.producer.stop(), timeout)

    async def stop(self, timeout: float = CLOSE_S) -> None:
        # Concurrently: one unreachable partition leader must not cost each producer its timeout.
        await asyncio.gather(*(self.released(Partition(tp), timeout) for tp in list(self._txns)))


def delivery_for(
    settings: WorkerSettings, parts: Callable[[], Iterable[Partition]], published: Published, fail: Fail
) -> Delivery:
    return (ExactlyOnce if settings.exactly_once else AtLeastOnce)(settings, parts, published, fail)


async def close_client(what: str, stopping: Awaitable[None], timeout: float = CLOSE_S) -> None:
    """Await a Kafka client's stop, at most `timeout` s; a failure or a timeout is logged, not raised."""
    task = asyncio.ensure_future(stopping)
    if not await within(task, timeout):
        log.warning("worker.close_timeout", client=what, seconds=round(timeout, 2))
    elif not task.cancelled() and task.exception() is not None:
        e = task.exception()
        log.warning("worker.close_failed", client=what, error=f"{type(e).__name__}: {e}")
