"""Small aiokafka helpers for the pipeline tests (real broker, no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import ConsumerRecord, RecordMetadata

REPO = Path(__file__).resolve().parents[2]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def create_topics(bootstrap: str, partitions: dict[str, int]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, n, 1) for t, n in partitions.items()])
    finally:
        await admin.close()


async def produce(
    bootstrap: str, topic: str, messages: list[tuple[bytes | None, bytes, int | None]]
) -> list[RecordMetadata]:
    """Send (key, value, partition) messages in order; returns where each landed."""
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await p.start()
    try:
        futs = [await p.send(topic, v, key=k, partition=part) for k, v, part in messages]
        return [await f for f in futs]
    finally:
        await p.stop()


async def read_all(
    bootstrap: str,
    topics: list[str],
    expected: int,
    *,
    timeout: float = 60.0,
    settle: float = 1.0,
    read_committed: bool = False,
) -> list[ConsumerRecord]:
    """Read the topics from the beginning until `expected` messages arrived, then `settle` more
    seconds (so extra duplicates would be seen too)."""
    c = AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed" if read_committed else "read_uncommitted",
    )
    await c.start()
    out: list[ConsumerRecord] = []
    try:
        deadline = time.monotonic() + timeout
        quiet_until: float | None = None
        while time.monotonic() < deadline:
            got = await c.getmany(timeout_ms=200)
            for msgs in got.values():
                out.extend(msgs)
            if len(out) >= expected:
                quiet_until = quiet_until or time.monotonic() + settle
                if time.monotonic() >= quiet_until:
                    break
    finally:
        await c.stop()
    return out


async def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        return {p: await c.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        await c.stop()


async def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


def event(
    i: int, *, prefix: str = "ev", questions: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """A short, valid evidence event (few tokens, so the tiny model decides it quickly)."""
    state: Any = (
        {"host": f"web-{i:02d}", "disk_pct": 80 + i % 20} if i % 2 else f"Login failures for user{i}: {i * 3}"
    )
    return {
        "event_id": f"{prefix}-{i:04d}",
        "source": "alert" if i % 3 else "ticket",
        "tenant": "acme",
        "created_at": "2026-11-28T08:00:00Z",
        **extra,
        "request": {
            "state": state,
            "questions": questions
            or {
                "act": {"type": "noul", "instructions": "Act now?"},
                "team": {"type": "choice", "criteria": {"ops": None, "db": "database", "net": None}},
                "sev": {"type": "score", "criteria": ["low", "mid", "high"]},
            },
        },
    }


def encode(obj: Any) -> bytes:
    return orjson.dumps(obj)


def headers(msg: ConsumerRecord) -> dict[str, bytes]:
    return dict(msg.headers or ())


def spawn_worker(
    args: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`prism run ...` as a real subprocess (its own process group, logs to a file)."""
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    log = log_path.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "prism_pipeline.cli", "--log-json", "run", *args],
        cwd=REPO,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_worker(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=timeout)


class Tail:
    """A background reader of topics from the beginning: `messages` grows as they arrive."""

    def __init__(self, bootstrap: str, topics: list[str], read_committed: bool = False) -> None:
        self.messages: list[ConsumerRecord] = []
        self._consumer = AIOKafkaConsumer(
            *topics,
            bootstrap_servers=bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            isolation_level="read_committed" if read_committed else "read_uncommitted",
        )
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Tail:
        await self._consumer.start()
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            for msgs in (await self._consumer.getmany(timeout_ms=100)).values():
                self.messages.extend(msgs)

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._consumer.stop()

    def keys(self) -> set[bytes]:
        return {m.key for m in self.messages if m.key is not None}
