"""The local 3-node KRaft cluster (`ops/kafka/kafka.sh cluster`, `ops/load/cluster.py`) against
aiokafka: replicated topics, a leader SIGKILLed without losing an acknowledged write, a node that
comes back into sync on its old address, and a stop that leaves no JVM behind."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ops.load.cluster import SCRIPT, LocalCluster
from prism_pipeline.local_kafka import LocalKafkaError
from tests.ops.test_kafka_broker import _alive, _drain, _java_processes_for

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


async def _produce(bootstrap: str, topic: str, values: list[bytes]) -> list[int]:
    """acks=all, idempotent: each value acknowledged once 2 in-sync replicas hold it."""
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await p.start()
    try:
        return [(await p.send_and_wait(topic, v, partition=0)).offset for v in values]
    finally:
        await p.stop()


def test_cluster_replicates_survives_a_leader_kill_and_stops_clean() -> None:
    cluster = LocalCluster(nodes=3)
    bootstrap = cluster.start()
    workdir = cluster.workdir
    try:
        pids = cluster.status()
        assert sorted(pids) == [1, 2, 3] and all(p is not None and _alive(p) for p in pids.values())
        for node in (1, 2, 3):
            assert _java_processes_for(workdir / f"node-{node}") == [pids[node]]
        assert len(bootstrap.split(",")) == 3

        # Topics made by the script get replication factor 3 and min.insync.replicas 2.
        topic = "replicated"
        subprocess.run(["bash", str(SCRIPT), "cluster", "topics", str(workdir), f"{topic}:2"], check=True)
        described = subprocess.run(
            ["bash", str(SCRIPT), "cluster", "describe", str(workdir), topic],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert "ReplicationFactor: 3" in described and "min.insync.replicas=2" in described, described
        parts = asyncio.run(cluster.describe([topic]))
        assert {p: d["replicas"] for (_, p), d in parts.items()} == {0: [1, 2, 3], 1: [1, 2, 3]}

        first = [f"a{i}".encode() for i in range(30)]
        second = [f"b{i}".encode() for i in range(30)]
        assert asyncio.run(_produce(bootstrap, topic, first)) == list(range(30))
        victim = asyncio.run(cluster.leader(topic, 0))
        cluster.node_kill(victim)
        assert cluster.status()[victim] is None and not _alive(pids[victim])
        # Writes go on once a surviving in-sync replica leads; none acknowledged before is lost.
        assert asyncio.run(_produce(bootstrap, topic, second)) == list(range(30, 60))
        after = asyncio.run(cluster.describe([topic]))[(topic, 0)]
        assert after["leader"] not in (victim, -1) and victim not in after["isr"], after

        async def read_back() -> list[bytes]:
            c = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest")
            await c.start()
            try:
                tp = TopicPartition(topic, 0)
                c.assign([tp])
                return [r.value for r in await _drain(c, [tp])]
            finally:
                await c.stop()

        assert asyncio.run(read_back()) == first + second

        # The node comes back on its old address and catches up into the in-sync set.
        old_address = cluster.address(victim)
        cluster.node_start(victim)
        assert cluster.address(victim) == old_address and cluster.status()[victim] is not None
        asyncio.run(cluster.wait_in_sync([topic], timeout=90))
        assert asyncio.run(cluster.describe([topic]))[(topic, 0)]["isr"] == [1, 2, 3]
        with pytest.raises(LocalKafkaError, match="already running"):
            cluster.node_start(victim)
    finally:
        final = cluster.status()
        cluster.stop()
    assert all(not _alive(p) for p in final.values() if p is not None)
    assert all(_java_processes_for(workdir / f"node-{n}") == [] for n in (1, 2, 3))
    assert not workdir.exists()  # a temp dir the cluster made is removed with it
    cluster.stop()  # idempotent


def test_cluster_commands_name_bad_arguments(tmp_path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(SCRIPT), "cluster", *args], capture_output=True, text=True)

    assert "no cluster in" in run("node-kill", str(tmp_path), "1").stderr
    assert "bad node count" in run("start", str(tmp_path / "x"), "0").stderr
    assert "usage: kafka.sh cluster" in run("frobnicate").stderr
    with pytest.raises(ValueError, match="nodes must be 1..9"):
        LocalCluster(nodes=0)
