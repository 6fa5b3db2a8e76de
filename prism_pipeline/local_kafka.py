"""A real local Apache Kafka on loopback, for tests, `prism demo` and the fault scenarios.

The brokers are the ones ops/kafka/kafka.sh runs (Maven Central jars on the local JVM, KRaft,
no Docker): one broker (`LocalKafka`, `kafka.sh start DIR`) or an N-node cluster (`LocalCluster`
in ops/load/cluster.py, `kafka.sh cluster start DIR N`). `ScriptedBrokers` holds what both share:
the script, the work dir, starting and stopping, readiness checked with Kafka Metadata requests
(so "started" means a client can actually talk to every node) and topic creation.
"""

from __future__ import annotations

import asyncio
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
from typing import TYPE_CHECKING, Self

import structlog

if TYPE_CHECKING:
    # Imported where used: `prism` commands that never touch a local broker skip loading aiokafka.
    from aiokafka.admin import AIOKafkaAdminClient

log = structlog.get_logger(__name__)

# The repo layout puts the script two levels above this package; PRISM_KAFKA_SCRIPT overrides it
# for installs that are not a checkout.
DEFAULT_SCRIPT = Path(__file__).resolve().parents[1] / "ops" / "kafka" / "kafka.sh"

# Kafka's TOPIC_ALREADY_EXISTS: creating a topic is meant to be idempotent.
_TOPIC_ALREADY_EXISTS = 36


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


class ScriptedBrokers:
    """The `nodes` brokers kafka.sh runs in one work dir (a fresh temp dir when None).

    One class for one broker and for N: kafka.sh runs the single broker as a one-node cluster, so
    starting, stopping, readiness and topics are the same for both. A subclass only names the
    script's words (`_SCRIPT_WORDS`, `_start_args`), where a node keeps its files (`_node_dir`)
    and which nodes should answer now (`_live_node_count`, `_live_bootstrap`).

    Use as a context manager, or call start() and stop(); stop() is idempotent. A temp dir this
    object created is removed on stop; a given workdir is kept, so a later start resumes its data.
    """

    _SCRIPT_WORDS: tuple[str, ...] = ()  # what comes before start/stop: () or ("cluster",)
    _LOG_EVENT = "local_kafka"  # structlog event prefix
    _WHAT = "local broker"  # in error messages
    _TEMP_PREFIX = "prism-kafka-"
    # `kafka.sh start DIR` runs one broker; `kafka.sh cluster start DIR N` takes 1..9.
    _DEFAULT_NODES = 1
    _MAX_NODES = 1
    _DEFAULT_START_TIMEOUT = 60.0  # seconds

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        nodes: int | None = None,
        script: str | os.PathLike[str] | None = None,
        start_timeout: float | None = None,
        stop_timeout: float = 30.0,
        stop_with_this_process: bool = True,
    ) -> None:
        nodes = self._DEFAULT_NODES if nodes is None else nodes
        if not 1 <= nodes <= self._MAX_NODES:
            raise ValueError(f"nodes must be 1..{self._MAX_NODES}, got {nodes}")
        self.nodes = nodes
        self._script = Path(script or os.environ.get("PRISM_KAFKA_SCRIPT") or DEFAULT_SCRIPT)
        self._given_workdir = Path(workdir) if workdir is not None else None
        self._workdir: Path | None = None
        self._owns_workdir = False
        self._start_timeout = self._DEFAULT_START_TIMEOUT if start_timeout is None else start_timeout
        self._stop_timeout = stop_timeout
        # The script's watchdog stops each broker if this process dies without calling stop().
        self._stop_with_this_process = stop_with_this_process
        self._bootstrap: str | None = None
        self._addresses: dict[int, str] = {}

    # ---- properties -----------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """Every node's address, comma separated (what clients are given: any live one answers)."""
        if self._bootstrap is None:
            raise LocalKafkaError(f"the {self._WHAT} is not running: call start() first")
        return self._bootstrap

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise LocalKafkaError(f"the {self._WHAT} has no work dir yet: call start() first")
        return self._workdir

    @property
    def running(self) -> bool:
        return self._bootstrap is not None

    @property
    def replication_factor(self) -> int:
        """What kafka.sh gives every topic: 3 copies where there are 3 nodes."""
        return min(3, self.nodes)

    @property
    def min_insync(self) -> int:
        """What kafka.sh gives every topic: an acks=all write is on 2 nodes where there are 2."""
        return min(2, self.nodes)

    def address(self, node: int) -> str:
        """host:port of one node (a cluster's node keeps it across restarts)."""
        return self._addresses[node]

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> str:
        """Start every node; return the bootstrap list once each node's Metadata lists all of them."""
        if self._bootstrap is not None:
            return self._bootstrap
        if not self._script.is_file():
            raise LocalKafkaError(f"Kafka script not found at {self._script} (set PRISM_KAFKA_SCRIPT)")
        if self._given_workdir is not None:
            self._workdir = self._given_workdir.resolve()
            self._workdir.mkdir(parents=True, exist_ok=True)
        else:
            self._workdir = Path(tempfile.mkdtemp(prefix=self._TEMP_PREFIX))
            self._owns_workdir = True
        t0 = time.monotonic()
        # The first start may run Maven (fetch); give it room beyond the brokers' own timeout.
        proc = self._run_script(
            "start", *self._start_args(), timeout=self._start_timeout + 300, env=self._env(owner=True)
        )
        if proc.returncode != 0:
            self._cleanup_workdir()
            raise LocalKafkaError(
                f"{self._command_name('start')} failed (exit {proc.returncode}):\n{proc.stderr.strip()}"
            )
        self._bootstrap = (self._workdir / "bootstrap").read_text().strip()
        self._addresses = dict(enumerate(self._bootstrap.split(","), start=1))
        for node in self._addresses:
            try:
                self.wait_node(node, timeout=max(5.0, self._start_timeout - (time.monotonic() - t0)))
            except LocalKafkaError as exc:
                tail = self.log_tail(node=node)
                self.stop()
                raise LocalKafkaError(f"{exc}\n---- log tail of node {node} ----\n{tail}") from exc
        log.info(
            f"{self._LOG_EVENT}.started",
            bootstrap=self._bootstrap,
            seconds=round(time.monotonic() - t0, 2),
            workdir=str(self._workdir),
            **self._log_context(),
        )
        return self._bootstrap

    def stop(self) -> None:
        """Stop every node (SIGTERM together, SIGKILL fallback) and remove a temp work dir."""
        if self._workdir is None:
            return
        t0 = time.monotonic()
        context = self._log_context()
        proc = self._run_script("stop", timeout=self._stop_timeout + 60, env=self._env(owner=False))
        if proc.returncode != 0:
            raise LocalKafkaError(
                f"{self._command_name('stop')} failed (exit {proc.returncode}):\n{proc.stderr.strip()}"
            )
        log.info(f"{self._LOG_EVENT}.stopped", seconds=round(time.monotonic() - t0, 2), **context)
        self._bootstrap = None
        self._cleanup_workdir()

    def wait_node(self, node: int, timeout: float = 60.0) -> int:
        """Until `node` answers Metadata listing every live node (it has caught up with the quorum);
        returns the count it lists."""
        try:
            return wait_for_metadata(self.address(node), timeout, min_brokers=self._live_node_count())
        except LocalKafkaError as exc:
            raise LocalKafkaError(f"node {node}: {exc}") from exc

    def log_tail(self, lines: int = 40, *, node: int = 1) -> str:
        """The last lines of one node's broker log, for error messages."""
        if self._workdir is None:
            return ""
        path = self._node_dir(node) / "logs" / "server.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no broker log at {path}: {exc})"

    # ---- topics ---------------------------------------------------------------------------------

    async def create_topics(
        self,
        topics: Iterable[TopicSpec | str],
        configs: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Create topics replicated `replication_factor` times with `min.insync.replicas`
        `min_insync` (and `configs` on each, then each spec's own); existing topics are left as
        they are."""
        from aiokafka.admin import NewTopic

        specs = [TopicSpec(t) if isinstance(t, str) else t for t in topics]
        if not specs:
            return
        new = []
        for spec in specs:
            topic_configs = {"min.insync.replicas": str(self.min_insync), **(configs or {}), **spec.configs}
            if spec.compact:
                topic_configs["cleanup.policy"] = "compact"
            new.append(
                NewTopic(spec.name, spec.partitions, self.replication_factor, topic_configs=topic_configs)
            )
        admin = await self._admin(timeout)
        try:
            response = await admin.create_topics(new, timeout_ms=int(timeout * 1000))
        finally:
            await admin.close()
        failures = []
        for name, code, *rest in response.topic_errors:
            if code not in (0, _TOPIC_ALREADY_EXISTS):
                message = rest[0] if rest else ""
                failures.append(f"{name}: error {code} {message or ''}".strip())
        if failures:
            raise LocalKafkaError("creating topics failed: " + "; ".join(failures))
        log.info(
            f"{self._LOG_EVENT}.topics_created", topics=[s.name for s in specs], rf=self.replication_factor
        )

    async def _admin(self, timeout: float = 30.0) -> AIOKafkaAdminClient:
        """A started admin client on the nodes that run now (one given a dead node waits on it)."""
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(
            bootstrap_servers=await asyncio.to_thread(self._live_bootstrap),
            request_timeout_ms=int(timeout * 1000),
        )
        await admin.start()
        return admin

    # ---- what a subclass may say differently ----------------------------------------------------

    def _start_args(self) -> tuple[str, ...]:
        """What comes after `start DIR`: the single broker takes nothing."""
        return ()

    def _node_dir(self, node: int) -> Path:
        """Where kafka.sh keeps one node's config, data, logs and pid: the single broker in the
        work dir itself."""
        return self.workdir

    def _live_node_count(self) -> int:
        """How many nodes a ready node's Metadata must list."""
        return self.nodes

    def _live_bootstrap(self) -> str:
        return self.bootstrap

    def _log_context(self) -> dict[str, object]:
        return {"nodes": self.nodes}

    # ---- internals ------------------------------------------------------------------------------

    def _command_name(self, command: str) -> str:
        return " ".join(("kafka.sh", *self._SCRIPT_WORDS, command))

    def _env(self, owner: bool) -> dict[str, str]:
        env = dict(os.environ)
        env["KAFKA_START_TIMEOUT"] = str(int(self._start_timeout))
        env["KAFKA_STOP_TIMEOUT"] = str(int(self._stop_timeout))
        if owner and self._stop_with_this_process:
            env["KAFKA_OWNER_PID"] = str(os.getpid())
        return env

    def _run_script(
        self, command: str, *args: str, timeout: float, env: dict[str, str]
    ) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                ["bash", str(self._script), *self._SCRIPT_WORDS, command, str(self._workdir), *args],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise LocalKafkaError(
                f"{self._command_name(command)} did not finish within {timeout:.0f}s\n"
                f"---- log tail of node 1 ----\n{self.log_tail()}"
            ) from exc

    def _cleanup_workdir(self) -> None:
        if self._owns_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
            self._owns_workdir = False

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class LocalKafka(ScriptedBrokers):
    """One local broker in `workdir` (`kafka.sh start DIR`): replication factor 1, fresh ports at
    every start, its files in the work dir itself (what ops/load/procs.py's BounceableBroker
    relaunches from)."""

    @property
    def pid(self) -> int | None:
        """The broker JVM's pid while it runs (from the pid file kafka.sh writes), else None."""
        if not self.running:
            return None
        try:
            return int((self.workdir / "pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def _log_context(self) -> dict[str, object]:
        return {"pid": self.pid}


def wait_for_metadata(bootstrap: str, timeout: float = 60.0, *, min_brokers: int = 1) -> int:
    """Retry a Metadata request until the broker lists at least `min_brokers` live brokers; return
    the count. An open port is not enough: a node accepts connections before it has joined the
    quorum, and a restarted one before the others see it again."""
    host, _, port_text = bootstrap.rpartition(":")
    if not host or not port_text.isdigit():
        raise LocalKafkaError(f"bad bootstrap address {bootstrap!r}: want host:port")
    deadline = time.monotonic() + timeout
    last_error = "no attempt made"
    while True:
        try:
            brokers = _metadata_broker_count(host, int(port_text), timeout=5.0)
            if brokers >= min_brokers:
                return brokers
            last_error = f"metadata lists {brokers} of {min_brokers} live brokers"
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
