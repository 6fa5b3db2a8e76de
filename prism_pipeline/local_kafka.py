"""A real single-node Apache Kafka broker on loopback, for tests and `prism demo`.

The broker is the one ops/kafka/kafka.sh runs (Maven Central jars on the local JVM, KRaft,
no Docker); this module drives the script and checks readiness with a Kafka Metadata request,
so "started" means a client can actually talk to the broker.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import structlog

log = structlog.get_logger(__name__)

# The repo layout puts the script two levels above this package; PRISM_KAFKA_SCRIPT overrides it
# for installs that are not a checkout.
_DEFAULT_SCRIPT = Path(__file__).resolve().parents[1] / "ops" / "kafka" / "kafka.sh"


class LocalKafkaError(RuntimeError):
    """The local broker could not be fetched, started, probed or stopped."""


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int = 1
    compact: bool = False
    configs: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("topic name must not be empty")
        if self.partitions < 1:
            raise ValueError(f"topic {self.name!r}: partitions must be >= 1, got {self.partitions}")


class LocalKafka:
    """Start, probe and stop one local broker in `workdir` (a fresh temp dir when None).

    Use as a context manager, or call start() and stop(). stop() is idempotent. A temp dir this
    object created is removed on stop; a given workdir is kept, so a later start resumes its data.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        script: str | os.PathLike[str] | None = None,
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
        stop_with_this_process: bool = True,
    ) -> None:
        self._script = Path(script or os.environ.get("PRISM_KAFKA_SCRIPT") or _DEFAULT_SCRIPT)
        self._given_workdir = Path(workdir) if workdir is not None else None
        self._workdir: Path | None = None
        self._owns_workdir = False
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        # The script's watchdog stops the broker if this process dies without calling stop().
        self._stop_with_this_process = stop_with_this_process
        self._bootstrap: str | None = None
        self._pid: int | None = None

    @property
    def bootstrap(self) -> str:
        if self._bootstrap is None:
            raise LocalKafkaError("the local broker is not running: call start() first")
        return self._bootstrap

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise LocalKafkaError("the local broker has no work dir yet: call start() first")
        return self._workdir

    @property
    def running(self) -> bool:
        return self._bootstrap is not None

    def start(self) -> str:
        """Start the broker and return its bootstrap address once a Metadata request succeeds."""
        if self._bootstrap is not None:
            return self._bootstrap
        if not self._script.is_file():
            raise LocalKafkaError(f"Kafka script not found at {self._script} (set PRISM_KAFKA_SCRIPT)")
        if self._given_workdir is not None:
            self._workdir = self._given_workdir
            self._workdir.mkdir(parents=True, exist_ok=True)
        else:
            self._workdir = Path(tempfile.mkdtemp(prefix="prism-kafka-"))
            self._owns_workdir = True
        env = dict(os.environ)
        env["KAFKA_START_TIMEOUT"] = str(int(self._start_timeout))
        env["KAFKA_STOP_TIMEOUT"] = str(int(self._stop_timeout))
        if self._stop_with_this_process:
            env["KAFKA_OWNER_PID"] = str(os.getpid())
        t0 = time.monotonic()
        # The first start may run Maven (fetch); give it room beyond the broker's own timeout.
        proc = self._run_script("start", env=env, timeout=self._start_timeout + 300)
        if proc.returncode != 0:
            self._cleanup_workdir()
            raise LocalKafkaError(f"kafka.sh start failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
        bootstrap = (self._workdir / "bootstrap").read_text().strip()
        self._pid = int((self._workdir / "pid").read_text().strip())
        self._bootstrap = bootstrap
        remaining = max(5.0, self._start_timeout - (time.monotonic() - t0))
        try:
            brokers = wait_for_metadata(bootstrap, timeout=remaining)
        except LocalKafkaError as exc:
            tail = self.log_tail()
            self.stop()
            raise LocalKafkaError(f"{exc}\n---- broker log tail ----\n{tail}") from exc
        log.info(
            "local_kafka.started",
            bootstrap=bootstrap,
            pid=self._pid,
            brokers=brokers,
            seconds=round(time.monotonic() - t0, 2),
            workdir=str(self._workdir),
        )
        return bootstrap

    def stop(self) -> None:
        """Stop the broker (SIGTERM, then SIGKILL) and remove a temp work dir."""
        if self._workdir is None:
            return
        t0 = time.monotonic()
        proc = self._run_script("stop", env=dict(os.environ), timeout=self._stop_timeout + 30)
        if proc.returncode != 0:
            raise LocalKafkaError(f"kafka.sh stop failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
        log.info("local_kafka.stopped", pid=self._pid, seconds=round(time.monotonic() - t0, 2))
        self._bootstrap = None
        self._cleanup_workdir()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the broker's log, for error messages."""
        if self._workdir is None:
            return ""
        path = self._workdir / "logs" / "server.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no broker log at {path}: {exc})"

    async def create_topics(self, topics: Iterable[TopicSpec | str], timeout: float = 30.0) -> None:
        """Create topics (1 replica each); topics that already exist are left as they are."""
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        specs = [TopicSpec(t) if isinstance(t, str) else t for t in topics]
        if not specs:
            return
        new = []
        for spec in specs:
            configs = dict(spec.configs)
            if spec.compact:
                configs["cleanup.policy"] = "compact"
            new.append(NewTopic(spec.name, spec.partitions, 1, topic_configs=configs))
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=int(timeout * 1000))
        await admin.start()
        try:
            response = await admin.create_topics(new, timeout_ms=int(timeout * 1000))
        finally:
            await admin.close()
        failures = []
        for name, code, *rest in response.topic_errors:
            # 36 = TOPIC_ALREADY_EXISTS: creating is meant to be idempotent.
            if code not in (0, 36):
                message = rest[0] if rest else ""
                failures.append(f"{name}: error {code} {message or ''}".strip())
        if failures:
            raise LocalKafkaError("creating topics failed: " + "; ".join(failures))
        log.info("local_kafka.topics_created", topics=[s.name for s in specs])

    def _run_script(
        self, command: str, *, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                ["bash", str(self._script), command, str(self._workdir)],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise LocalKafkaError(
                f"kafka.sh {command} did not finish within {timeout:.0f}s\n{self.log_tail()}"
            ) from exc

    def _cleanup_workdir(self) -> None:
        if self._owns_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
            self._owns_workdir = False

    def __enter__(self) -> LocalKafka:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def wait_for_metadata(bootstrap: str, timeout: float = 60.0) -> int:
    """Retry a Metadata request until the broker lists at least one live broker; return the count."""
    host, _, port_text = bootstrap.rpartition(":")
    if not host or not port_text.isdigit():
        raise LocalKafkaError(f"bad bootstrap address {bootstrap!r}: want host:port")
    deadline = time.monotonic() + timeout
    last_error = "no attempt made"
    while True:
        try:
            brokers = _metadata_broker_count(host, int(port_text), timeout=5.0)
            if brokers > 0:
                return brokers
            last_error = "metadata lists no live broker yet"
        except (OSError, struct.error, ValueError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise LocalKafkaError(f"broker at {bootstrap} not ready within {timeout:.0f}s ({last_error})")
        time.sleep(0.25)


def _metadata_broker_count(host: str, port: int, timeout: float) -> int:
    # Metadata v4 (the oldest Kafka 4 still serves): header v1, topics=null (all), no auto-create.
    correlation_id = 1
    client_id = b"prism-probe"
    body = struct.pack(">hhih", 3, 4, correlation_id, len(client_id)) + client_id
    body += struct.pack(">ib", -1, 0)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        payload = _recv_exact(sock, size)
    got_id, _throttle_ms, broker_count = struct.unpack_from(">iii", payload, 0)
    if got_id != correlation_id:
        raise ValueError(f"metadata response has correlation id {got_id}, expected {correlation_id}")
    return broker_count


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ConnectionError("broker closed the connection mid-response")
        chunks += chunk
    return bytes(chunks)
