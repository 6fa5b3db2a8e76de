"""Load generator: N concurrent producers send an event mix to the evidence topic, bounded by count
and/or duration, optionally paced to a total rate. Loopback brokers only.

    python -m ops.load.generate --brokers 127.0.0.1:9092 --topic prism.evidence \
        --count 2000 --duration 120 --producers 4 --rate 50 --poison-fraction 0.05 \
        --manifest produced.jsonl

The manifest (one JSON line per acknowledged message: partition, offset, key, expected outcome)
lets `ops.load.check` verify not only that every offset got one outcome but the right one.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from ops.load.events import EventMix, Message

log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES = 32 * 1024 * 1024  # the producer's request cap: hostile cases go up to ~10 MB


class LoadError(ValueError):
    """A generator or checker setting that cannot work; the message names it."""


def require_loopback(bootstrap: str) -> list[str]:
    """The bootstrap servers, refusing anything that is not a loopback address."""
    servers = [s.strip() for s in bootstrap.split(",") if s.strip()]
    if not servers:
        raise LoadError("no bootstrap server given")
    for server in servers:
        host = server.rsplit(":", 1)[0].strip("[]")
        if host == "localhost":
            continue
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise LoadError(
                f"broker {server!r} is not a loopback address: the load tools only target local brokers"
            )
    return servers


@dataclass(frozen=True)
class Produced:
    """One acknowledged input message: where it landed and what outcome it is owed."""

    partition: int
    offset: int
    key: str
    kind: str
    expect: str
    reason: str | None
    label: str
    timestamp_ms: int


@dataclass
class LoadReport:
    produced: list[Produced]
    seconds: float
    send_retries: int

    @property
    def rate(self) -> float:
        return len(self.produced) / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, object]:
        kinds: dict[str, int] = {}
        for p in self.produced:
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
        return {
            "produced": len(self.produced),
            "seconds": round(self.seconds, 3),
            "events_per_s": round(self.rate, 2),
            "kinds": kinds,
            "send_retries": self.send_retries,
        }


def write_manifest(produced: Sequence[Produced], path: Path) -> None:
    with path.open("wb") as f:
        for p in produced:
            f.write(orjson.dumps(asdict(p)) + b"\n")


def read_manifest(path: Path) -> list[Produced]:
    return [Produced(**orjson.loads(line)) for line in path.read_bytes().splitlines() if line.strip()]


async def generate(
    bootstrap: str,
    topic: str,
    *,
    count: int | None = None,
    duration_s: float | None = None,
    producers: int = 1,
    rate: float | None = None,
    poison_fraction: float = 0.0,
    prefix: str | None = None,
    seed: int = 0,
    samples: Path | None = None,
    messages: Sequence[Message] | Callable[[int], Message] | None = None,
    stop: asyncio.Event | None = None,
    send_timeout_s: float = 120.0,
) -> LoadReport:
    """Produce messages until `count` are acknowledged, `duration_s` passed, or `stop` is set.

    `messages` replaces the default `EventMix`: a fixed sequence (which also bounds the count) or a
    function of the message index. `rate` is the total target in messages/s over all producers
    (None: as fast as the broker takes them). A send that fails is retried (the broker may be
    restarting) until `send_timeout_s`; the generator never skips a message.
    """
    require_loopback(bootstrap)
    if producers < 1:
        raise LoadError(f"producers must be >= 1, got {producers}")
    if rate is not None and rate <= 0:
        raise LoadError(f"rate must be > 0 messages/s, got {rate}")
    if isinstance(messages, Sequence):
        count = len(messages) if count is None else min(count, len(messages))
    if count is None and duration_s is None and stop is None:
        raise LoadError("unbounded load: give a count, a duration, or both")
    if count is not None and count < 0:
        raise LoadError(f"count must be >= 0, got {count}")
    if isinstance(messages, Sequence):
        fixed = messages
        make: Callable[[int], Message] = lambda i: fixed[i]  # noqa: E731
    elif messages is not None:
        make = messages
    else:
        make = EventMix(prefix or f"load-{uuid.uuid4().hex[:8]}", poison_fraction, seed, samples).message

    t0 = time.monotonic()
    deadline = None if duration_s is None else t0 + duration_s
    next_index = 0
    produced: list[Produced] = []
    retries = 0

    def claim() -> int | None:
        nonlocal next_index
        if (count is not None and next_index >= count) or (stop is not None and stop.is_set()):
            return None
        if deadline is not None and time.monotonic() >= deadline:
            return None
        i = next_index
        next_index += 1
        return i

    async def send_one(p: AIOKafkaProducer, i: int) -> None:
        nonlocal retries
        msg = make(i)
        give_up = time.monotonic() + send_timeout_s
        while True:
            try:
                meta = await (await p.send(topic, msg.value, key=msg.key))
                break
            except KafkaError as e:
                if time.monotonic() >= give_up:
                    raise
                retries += 1
                log.warning("load.send_retry", index=i, error=f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.5)
        produced.append(
            Produced(
                meta.partition,
                meta.offset,
                msg.key.decode("utf-8", "replace"),
                msg.kind,
                msg.expect,
                msg.reason,
                msg.label,
                meta.timestamp,
            )
        )

    async def producer_task() -> None:
        p = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            acks="all",
            # Idempotence: the broker drops the copy a retried batch would otherwise leave behind.
            enable_idempotence=True,
            max_request_size=MAX_MESSAGE_BYTES,
            request_timeout_ms=30000,
        )
        await p.start()
        try:
            pending: set[asyncio.Task[None]] = set()
            while (i := claim()) is not None:
                if rate is not None:
                    due = t0 + i / rate
                    if (wait := due - time.monotonic()) > 0:
                        await asyncio.sleep(wait)
                pending.add(asyncio.create_task(send_one(p, i)))
                if len(pending) >= 64:  # bounded in-flight per producer
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        t.result()
            if pending:
                for t in await asyncio.gather(*pending, return_exceptions=True):
                    if isinstance(t, BaseException):
                        raise t
        finally:
            await p.stop()

    await asyncio.gather(*(producer_task() for _ in range(producers)))
    produced.sort(key=lambda x: (x.partition, x.offset))
    report = LoadReport(produced, time.monotonic() - t0, retries)
    log.info("load.done", **report.summary())
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.load.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--brokers", required=True, help="bootstrap servers (loopback only)")
    p.add_argument("--topic", required=True, help="evidence topic")
    p.add_argument("--count", type=int, default=None, help="messages to send (default: until --duration)")
    p.add_argument("--duration", type=float, default=None, help="seconds to send for")
    p.add_argument("--producers", type=int, default=1, help="concurrent producers (default 1)")
    p.add_argument("--rate", type=float, default=None, help="total messages/s (default: unpaced)")
    p.add_argument("--poison-fraction", type=float, default=0.0, help="share of poison messages, 0..1")
    p.add_argument("--prefix", default=None, help="event id prefix (default: random)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--samples", type=Path, default=None, help="JSON-lines events to sample (default: bundled)"
    )
    p.add_argument("--manifest", type=Path, default=None, help="write what was produced here (JSON lines)")
    a = p.parse_args(argv)
    from prism_pipeline.logs import configure_logging

    configure_logging("INFO", None)
    try:
        report = asyncio.run(
            generate(
                a.brokers,
                a.topic,
                count=a.count,
                duration_s=a.duration,
                producers=a.producers,
                rate=a.rate,
                poison_fraction=a.poison_fraction,
                prefix=a.prefix,
                seed=a.seed,
                samples=a.samples,
            )
        )
    except (LoadError, ValueError, OSError) as e:
        sys.stderr.write(f"generate: {e}\n")
        return 2
    if a.manifest is not None:
        write_manifest(report.produced, a.manifest)
    sys.stdout.write(orjson.dumps(report.summary()).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
