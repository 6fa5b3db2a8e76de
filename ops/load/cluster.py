"""A real local replicated Kafka cluster for the fault scenarios: N KRaft nodes on loopback.

The cluster is the one `ops/kafka/kafka.sh cluster` runs (each node a combined broker+controller,
all N voters of the quorum, Maven Central jars on the local JVM, no Docker). Starting, stopping,
readiness and topics are `prism_pipeline.local_kafka.ScriptedBrokers`, shared with the single
broker (kafka.sh's one-node cluster); this module adds what the scenarios need: stop, kill and
restart one node on its own address, find a partition's leader, and wait until every replica is
back in sync (a rolling restart must not stop the next node while the last one is still catching
up, or a partition drops below `min.insync.replicas`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from prism_pipeline.local_kafka import DEFAULT_SCRIPT, LocalKafkaError, ScriptedBrokers

log = structlog.get_logger(__name__)

# The script this cluster runs (tests call its `cluster topics` and `cluster describe` directly).
SCRIPT = DEFAULT_SCRIPT
INTERNAL_TOPICS = ("__consumer_offsets", "__transaction_state")


class LocalCluster(ScriptedBrokers):
    """Start, probe, fault and stop an N-node local cluster (`nodes`, default 3, at most 9) in
    `workdir` (a temp dir when None).

    Use as a context manager, or call start() and stop(); stop() is idempotent. A temp dir this
    object made is removed on stop; a given workdir is kept (a later start resumes its data).
    """

    _SCRIPT_WORDS = ("cluster",)
    _LOG_EVENT = "local_cluster"
    _WHAT = "local cluster"
    _TEMP_PREFIX = "prism-cluster-"
    _DEFAULT_NODES = 3
    _MAX_NODES = 9
    # N JVMs start together on the same cores, and each waits for a quorum of the others.
    _DEFAULT_START_TIMEOUT = 90.0

    def pid(self, node: int) -> int | None:
        """The node's JVM pid while it runs, else None."""
        return self.status().get(node)

    # ---- faults ---------------------------------------------------------------------------------

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
        proc = self._run_script("status", timeout=30, env=self._env(owner=False))
        if proc.returncode != 0:
            raise LocalKafkaError(f"kafka.sh cluster status failed:\n{proc.stderr}")
        out: dict[int, int | None] = {}
        for line in proc.stdout.split("\n"):
            if line.strip():
                node, pid, _ = line.split()
                out[int(node)] = None if pid == "down" else int(pid)
        return out

    # ---- metadata -------------------------------------------------------------------------------

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

    # ---- what the cluster says differently from the single broker ------------------------------

    def _start_args(self) -> tuple[str, ...]:
        """`cluster start DIR N`: the script checks N against a kept work dir's cluster."""
        return (str(self.nodes),)

    def _node_dir(self, node: int) -> Path:
        return self.workdir / f"node-{node}"

    def _live_node_count(self) -> int:
        """A node that comes back must see the nodes that run now, not those that are down."""
        return sum(1 for pid in self.status().values() if pid is not None)

    def _live_bootstrap(self) -> str:
        up = [self._addresses[n] for n, pid in self.status().items() if pid is not None]
        return ",".join(up) or self.bootstrap

    # ---- internals ------------------------------------------------------------------------------

    def _node(self, command: str, node: int, owner: bool = False) -> float:
        if node not in self._addresses:
            raise LocalKafkaError(f"no node {node} (nodes 1..{self.nodes})")
        t0 = time.monotonic()
        proc = self._run_script(command, str(node), timeout=self._start_timeout + 60, env=self._env(owner))
        if proc.returncode != 0:
            raise LocalKafkaError(f"kafka.sh cluster {command} {node} failed:\n{proc.stderr}")
        took = time.monotonic() - t0
        log.info(f"local_cluster.{command.replace('-', '_')}", node=node, seconds=round(took, 2))
        return took
