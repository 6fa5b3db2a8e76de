"""Shared by the tests that run `prism run` as a subprocess against the session's broker: the
topics a worker is pointed at, and the two ways a test ends a worker's run (imported by file name,
like tests/serve/serve_helpers.py).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.pipeline.kafkautil import create_topics, spawn_worker, stop_worker, unique, wait_for


@dataclass(frozen=True)
class WorkerTopics:
    """The topics and consumer group of the `prism run` workers under test.

    Every test shares the session's broker, so each gets fresh names: a reused topic or group would
    mix another test's messages or committed offsets into its verdict.
    """

    bootstrap: str
    input: str
    output: str
    dead_letters: str
    group: str

    @classmethod
    async def create(cls, bootstrap: str) -> WorkerTopics:
        """Fresh topics on the broker: the input on two partitions, so that each partition's
        commits are checked apart, and the outcome topics on one."""
        topics = cls(bootstrap, unique("in"), unique("out"), unique("dlq"), unique("g"))
        await create_topics(bootstrap, {topics.input: 2, topics.output: 1, topics.dead_letters: 1})
        return topics

    def worker_args(self) -> list[str]:
        """The `prism run` flags that make a worker a member of this group on these topics."""
        return [
            "--brokers",
            self.bootstrap,
            "--input-topic",
            self.input,
            "--output-topic",
            self.output,
            "--dlq-topic",
            self.dead_letters,
            "--group-id",
            self.group,
        ]


async def run_worker_until(
    args: list[str],
    log_path: Path,
    done: Callable[[], bool],
    timeout: float,
    what: str,
    *,
    stop_timeout: float = 60.0,
) -> int:
    """Run `prism run` until `done()`, then SIGTERM it; its exit code.

    The wait also ends when the worker exits by itself, so a crashed worker fails the test with
    its exit code (and the caller's log tail) at once rather than with a timeout.
    """
    proc = spawn_worker(args, log_path)
    try:
        await wait_for(lambda: done() or proc.poll() is not None, timeout, what)
    finally:
        code = stop_worker(proc, signal.SIGTERM, timeout=stop_timeout)
    return code


async def kill_worker_when(
    args: list[str], log_path: Path, done: Callable[[], bool], timeout: float, what: str
) -> None:
    """Run `prism run` until `done()`, then SIGKILL it: a crash mid-stream, with no chance to
    finish a batch, publish or commit.

    It must still be running when the kill comes, or this fails with its log's tail: a worker that
    exited first was not crashed mid-stream, and the restart after it would prove nothing.
    """
    proc = spawn_worker(args, log_path)
    try:
        await wait_for(lambda: done() or proc.poll() is not None, timeout, what)
        assert proc.poll() is None, log_path.read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
