"""A real local replicated Kafka cluster for the fault scenarios: N KRaft nodes on loopback.

The cluster is the one `ops/kafka/kafka.sh cluster` runs (each node a combined broker+controller,
all N voters of the quorum, Maven Central jars on the local JVM, no Docker); this module drives
the script the way `prism_pipeline.local_kafka.LocalKafka` drives the single broker, and adds
what the scenarios need: stop, kill and restart one node on its own address, find a partition's
leader, and wait until every replica is back in sync (a rolling restart must not stop the next
node while the last one is still catching up, or a partition drops below `min.insync.replicas`).

Readiness is checked with Kafka Metadata requests, so "started" means a client sees every node.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from prism_pipeline.local_kafka import (
    LocalKafkaError,
    TopicSpec,
    _metadata_broker_count,
)

log = structlog.get_logger(__name__)

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "kafka" / "kafka.sh"
INTERNAL_TOPICS = ("__consumer_offsets", "__transaction_state")


class LocalCluster:
    """Start, probe, fault and stop an N-node local cluster in `workdir` (a temp dir when None).

    Use as a context manager, or call start() and stop(); stop() is idempotent. A temp dir this
    object made is removed on stop; a given workdir is kept (a later start resumes its data).
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        nodes: int = 3,
        script: str | os.PathLike[str] | None = None,
        start_timeout: float = 90.0,
        stop_timeout: float = 30.0,
        stop_with_this_process: bool = True,
    ) -> None:
        if not 1 <= nodes <= 9:
            raise ValueError(f"nodes must be 1..9, got {nodes}")
        self.nodes = nodes
        self._script = Path(script or os.environ.get("PRISM_KAFKA_SCRIPT") or SCRIPT)
        self._given = Path(workdir) if workdir is not None else None
        self._workdir: Path | None = None
        self._owns_workdir = False
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._stop_with_this_process = stop_with_this_process
        self._bootstrap: str | None = None
        self._addresses: dict[int, str] = {}

    # ---- properties -----------------------------------------------------------------------------

    @property
    def bootstrap(self) -> str:
        """Every node's address, comma separated (what clients are given: any live one answers)."""
        if self._bootstrap is None:
            raise LocalKafkaError("the local cluster is not running: call start() first")
        return self._bootstrap

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise LocalKafkaError("the local cluster has no work dir yet: call start() first")
        return self._workdir

    @property
    def replication_factor(self) -> int:
        return min(3, self.nodes)

    @property
    def min_insync(self) -> int:
        return min(2, self.nodes)

    def address(self, node: int) -> str:
        """host:port of one node (fixed for the cluster's life, across restarts)."""
        return self._addresses[node]

    def pid(self, node: int) -> int | None:
        """The node's JVM pid while it runs, else None."""
        return self.status().get(node)

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> str:
        """Start every node; return the bootstrap list once each node's Metadata lists all N."""
        if self._bootstrap is not None:
            return self._bootstrap
        if not self._script.is_file():
            raise LocalKafkaError(f"Kafka script not found at {self._script} (set PRISM_KAFKA_SCRIPT)")
        if self._given is not None:
            self._workdir = self._given.resolve()
            self._workdir.mkdir(parents=True, exist_ok=True)
        else:
            self._workdir = Path(tempfile.mkdtemp(prefix="prism-cluster-"))
            self._owns_workdir = True
        t0 = time.monotonic()
        proc = self._script_run(
            "start", str(self.nodes), timeout=self._start_timeout + 300, env=self._env(owner=True)
        )
        if proc.returncode != 0:
            self._cleanup()
            raise LocalKafkaError(f"kafka.sh cluster start failed (exit {proc.returncode}):\n{proc.stderr}")
        self._bootstrap = (self._workdir / "bootstrap").read_text().strip()
        self._addresses = {i + 1: a for i, a in enumerate(self._bootstrap.split(","))}
        try:
            for node in self._addresses:
                self.wait_node(node, timeout=max(5.0, self._start_timeout - (time.monotonic() - t0)))
        except LocalKafkaError:
            self.stop()
            raise
        log.info(
            "local_cluster.started",
            bootstrap=self._bootstrap,
            nodes=self.nodes,
            seconds=round(time.monotonic() - t0, 2),
            workdir=str(self._workdir),
        )
        return self._bootstrap

    def stop(self) -> None:
        """Stop every node (SIGTERM together, SIGKILL fallback) and remove a temp work dir."""
        if self._workdir is None:
            return
        t0 = time.monotonic()
        proc = self._script_run("stop", timeout=self._stop_timeout + 60, env=self._env(owner=False))
        if proc.returncode != 0:
            raise LocalKafkaError(f"kafka.sh cluster stop failed (exit {proc.returncode}):\n{proc.stderr}")
        log.info("local_cluster.stopped", seconds=round(time.monotonic() - t0, 2))
        self._bootstrap = None
        self._cleanup()

    def node_stop(self, node: int) -> float:
        """Controlled shutdown of one node (SIGTERM: it hands its leaderships over first); seconds."""
        return self._node("node-stop", node)

    def node_kill(self, node: int) -> float:
        """SIGKILL one node: a crash, its leaderships move only once the controller fences it."""
        return self._node("node-kill", node)

    def node_start(self, node: int) -> float:
        """Start a stopped node on its old address and data; returns once clients see it."""
        took = self._node("node-start", node, owner=True)
        self.wait_node(node, timeout=self._start_timeout)
        return took

    def status(self) -> dict[int, int | None]:
        """{node id: pid, or None when the node is down}."""
        proc = self._script_run("status", timeout=30, env=self._env(owner=False))
        if proc.returncode != 0:
            raise LocalKafkaError(f"kafka.sh cluster status failed:\n{proc.stderr}")
        out: dict[int, int | None] = {}
        for line in proc.stdout.split("\n"):
            if line.strip():
                node, pid, _ = line.split()
                out[int(node)] = None if pid == "down" else int(pid)
        return out

    def wait_node(self, node: int, timeout: float = 60.0) -> None:
        """Until `node` answers Metadata listing every live node (it has caught up with the quorum)."""
        live = sum(1 for p in self.status().values() if p is not None)
        host, _, port = self.address(node).rpartition(":")
        deadline = time.monotonic() + timeout
        last = "no attempt made"
        while True:
            try:
                n = _metadata_broker_count(host, int(port), timeout=5.0)
                if n >= live:
                    return
                last = f"metadata lists {n} of {live} live nodes"
            except (OSError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                where = f"node {node} ({self.address(node)})"
                raise LocalKafkaError(f"{where} not ready within {timeout:.0f}s: {last}")
            time.sleep(0.25)

    def log_tail(self, node: int, lines: int = 40) -> str:
        path = self.workdir / f"node-{node}" / "logs" / "server.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"(no log at {path}: {e})"

    # ---- topics and metadata --------------------------------------------------------------------

    def _live_bootstrap(self) -> str:
        up = [self._addresses[n] for n, pid in self.status().items() if pid is not None]
        return ",".join(up) or self.bootstrap

    async def _admin(self, timeout: float = 30.0) -> AIOKafkaAdminClient:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=await asyncio.to_thread(self._live_bootstrap),
            request_timeout_ms=int(timeout * 1000),
        )
        await admin.start()
        return admin

    async def create_topics(
        self,
        topics: Iterable[TopicSpec | str],
        configs: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Create topics replicated `replication_factor` times with `min.insync.replicas`
        `min_insync` (and `configs` on each); existing topics are left as they are."""
        specs = [TopicSpec(t) if isinstance(t, str) else t for t in topics]
        new = []
        for s in specs:
            cfg = {"min.insync.replicas": str(self.min_insync), **(configs or {}), **s.configs}
            if s.compact:
                cfg["cleanup.policy"] = "compact"
            new.append(NewTopic(s.name, s.partitions, self.replication_factor, topic_configs=cfg))
        admin = await self._admin(timeout)
        try:
            response = await admin.create_topics(new, timeout_ms=int(timeout * 1000))
        finally:
            await admin.close()
        # 36 = TOPIC_ALREADY_EXISTS: creating is meant to be idempotent.
        errors = response.topic_errors
        failures = [f"{name}: error {code}" for name, code, *_ in errors if code not in (0, 36)]
        if failures:
            raise LocalKafkaError("creating topics failed: " + "; ".join(failures))
        log.info("local_cluster.topics_created", topics=[s.name for s in specs], rf=self.replication_factor)

    async def describe(self, topics: Iterable[str]) -> dict[tuple[str, int], dict[str, Any]]:
        """{(topic, partition): {"leader": node id or -1, "replicas": [...], "isr": [...]}}."""
        admin = await self._admin()
        try:
            got = await admin.describe_topics(list(topics))
        finally:
            await admin.close()
        out: dict[tuple[str, int], dict[str, Any]] = {}
        for t in got:
            for p in t["partitions"]:
                out[(t["topic"], int(p["partition"]))] = {
                    "leader": int(p["leader"]),
                    "replicas": sorted(int(r) for r in p["replicas"]),
                    "isr": sorted(int(r) for r in p["isr"]),
                }
        return out

    async def leader(self, topic: str, partition: int = 0) -> int:
        """The node that leads one partition now (-1 while none does)."""
        return (await self.describe([topic]))[(topic, partition)]["leader"]

    async def wait_leader(self, topic: str, partition: int, not_node: int, timeout: float = 60.0) -> float:
        """Wait until a live node other than `not_node` leads the partition; returns the seconds."""
        t0 = time.monotonic()
        while True:
            try:
                lead = await self.leader(topic, partition)
                if lead not in (-1, not_node):
                    return time.monotonic() - t0
            except Exception as e:  # noqa: BLE001 - a metadata call during a failover may fail; retry
                log.debug("local_cluster.leader_retry", error=f"{type(e).__name__}: {e}")
            if time.monotonic() - t0 > timeout:
                raise LocalKafkaError(f"{topic}/{partition}: no new leader within {timeout:.0f}s")
            await asyncio.sleep(0.25)

    async def wait_in_sync(self, topics: Iterable[str], timeout: float = 120.0) -> float:
        """Wait until every partition of `topics` (and of the offsets and transaction logs) has all
        its replicas in sync; returns the seconds waited."""
        names = [*topics, *INTERNAL_TOPICS]
        t0 = time.monotonic()
        behind: list[str] = []
        while True:
            try:
                parts = await self.describe(names)
                behind = [f"{t}/{p}" for (t, p), d in parts.items() if d["isr"] != d["replicas"]]
                if parts and not behind:
                    return time.monotonic() - t0
            except Exception as e:  # noqa: BLE001 - retried like the leader lookup
                behind = [f"({type(e).__name__}: {e})"]
            if time.monotonic() - t0 > timeout:
                raise LocalKafkaError(f"replicas not in sync within {timeout:.0f}s: {behind[:8]}")
            await asyncio.sleep(0.5)

    # ---- internals ------------------------------------------------------------------------------

    def _env(self, owner: bool) -> dict[str, str]:
        env = dict(os.environ)
        env["KAFKA_START_TIMEOUT"] = str(int(self._start_timeout))
        env["KAFKA_STOP_TIMEOUT"] = str(int(self._stop_timeout))
        if owner and self._stop_with_this_process:
            env["KAFKA_OWNER_PID"] = str(os.getpid())
        return env

    def _node(self, command: str, node: int, owner: bool = False) -> float:
        if node not in self._addresses:
            raise LocalKafkaError(f"no node {node} (nodes 1..{self.nodes})")
        t0 = time.monotonic()
        proc = self._script_run(command, str(node), timeout=self._start_timeout + 60, env=self._env(owner))
        if proc.returncode != 0:
            raise LocalKafkaError(f"kafka.sh cluster {command} {node} failed:\n{proc.stderr}")
        took = time.monotonic() - t0
        log.info(f"local_cluster.{command.replace('-', '_')}", node=node, seconds=round(took, 2))
        return took

    def _script_run(
        self, command: str, *args: str, timeout: float, env: dict[str, str]
    ) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                ["bash", str(self._script), "cluster", command, str(self._workdir), *args],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as e:
            raise LocalKafkaError(f"kafka.sh cluster {command} did not finish within {timeout:.0f}s") from e

    def _cleanup(self) -> None:
        if self._owns_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
            self._owns_workdir = False

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
