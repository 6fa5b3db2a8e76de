"""Bounded fault scenarios on a real 3-node KRaft cluster (`ops/kafka/kafka.sh cluster`): topics
replicated 3 times with min.insync.replicas 2, and the faults a replicated deployment meets - a
partition leader SIGKILLed under load, every node restarted in turn, workers added and removed.

Acceptance as in test_scenarios.py (nothing lost, conflicting or divergent, no worker crash), and
under exactly-once no duplicate either: the checker reads read_committed, so an aborted
transaction's records do not count, and a committed one is never repeated. The workers run the
int8 path, whose records are byte-identical however events are re-batched.

One cluster serves the module (about 12 s to start on 2 busy cores); each scenario makes its
own topics and group. Numbers of full runs are in ops/bench/RESULTS.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.load import scenarios
from ops.load.cluster import LocalCluster
from ops.load.scenarios import ScenarioConfig
from prism_pipeline.worker.runner import EXIT_ABANDONED
from tests.reliability.test_scenarios import assert_reconciled

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(module_tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(module_tmp_path, nodes=3)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster_config(scenario_config: ScenarioConfig) -> ScenarioConfig:
    # A pace the tiny model keeps up with on 2 shared cores, so the run ends soon after its faults.
    scenario_config.rate = 4.0
    scenario_config.events = 48
    return scenario_config


@pytest.mark.parametrize(("target", "exactly_once"), [("output", False), ("input", True)])
async def test_partition_leader_sigkilled_under_load(
    cluster: LocalCluster, cluster_config: ScenarioConfig, target: str, exactly_once: bool
) -> None:
    cluster_config.exactly_once = exactly_once
    # The stop is bounded (issue #23); CI's deadline is short, so a stop that reaches it costs little.
    cluster_config.worker_args = ["--stop-timeout-s", "15"]
    result = await scenarios.leader_kill(cluster_config, cluster, target)
    # A stop that reached its deadline (exit 3) is told apart from a crash: see below.
    stops = {k: v for k, v in result.worker_exits.items() if k.endswith(".stop")}
    result.worker_exits = {k: v for k, v in result.worker_exits.items() if k not in stops}
    rep = assert_reconciled(result)
    notes = result.notes
    if exactly_once:
        assert rep.duplicates == 0, result.summary()
    inp, out, _ = notes["topics"]
    # The victim led the partition named, and (4 input partitions over 3 nodes) input partitions.
    assert 0 in notes["led"][out if target == "output" else inp], notes
    assert notes["led"].get(inp), notes
    assert notes["failover_s"] > 0
    # The pipeline went on deciding while the node was down, and kept every acknowledged input.
    assert notes["outcomes_before_restart"] > notes["outcomes_at_kill"] > 0, notes
    # ...and the node came back into every in-sync replica set.
    assert all(d["isr"] == [1, 2, 3] for d in (await cluster.describe([inp, out])).values())
    # Seen once in four runs on 2 loaded cores (2026-12-01): after the node holding the group
    # coordinator was killed, an exactly-once worker's SIGTERM drain never finished (no log line for
    # 90 s, then the scenario's SIGKILL). Every stop now ends by itself: after a full drain (0), or
    # at its deadline with its in-flight work abandoned uncommitted (3, and the log says what),
    # which the strict data checks above (nothing lost, no duplicate under exactly-once) cover.
    assert all(rc == EXIT_ABANDONED for rc in stops.values()), result.summary()
    for name in stops:
        (log,) = cluster_config.workdir.glob(f"*.{name.removesuffix('.stop')}.log")
        assert '"worker.stop_abandoned"' in log.read_text(), (name, stops)


async def test_rolling_restart_of_all_three_nodes_under_load(
    cluster: LocalCluster, cluster_config: ScenarioConfig
) -> None:
    result = await scenarios.rolling_restart(cluster_config, cluster)
    assert_reconciled(result)
    restarts = result.notes["restarts"]
    assert [r["node"] for r in restarts] == [1, 2, 3], restarts
    assert sum(r["outcomes_during"] for r in restarts) > 0, restarts


async def test_workers_scaled_up_and_down_under_a_backlog(
    cluster: LocalCluster, cluster_config: ScenarioConfig
) -> None:
    # CI's bounded version: 1 -> 2 -> 1, one rebalance each way (every new worker loads the model,
    # 15-60 s on a busy 2-core machine); the full 1 -> 2 -> 4 -> 2 run is in ops/bench/RESULTS.md.
    result = await scenarios.scale(cluster_config, cluster, (1, 2, 1), phase_s=3.0, delay_ms=300.0)
    assert_reconciled(result)
    phases = result.notes["phases"]
    assert [p["workers"] for p in phases] == [1, 2, 1], phases
    assert [p.get("change") for p in phases[1:]] == ["1->2", "2->1"], phases
    # Every change was followed by progress: a pause was measured (outcomes resumed) each time.
    assert all(p["pause_s"] is not None and p["pause_s"] > 0 for p in phases[1:]), phases
    assert all(p["events_per_s"] for p in phases), phases
    assert result.worker_starts == 2


async def test_a_bounded_saturation_soak_with_every_fault(
    cluster: LocalCluster, scenario_config: ScenarioConfig
) -> None:
    # CI's bounded version of the 100,000-event, 31-minute soak (ops/bench/RESULTS.md): the engine
    # stand-in's declared 20 ms an event caps one worker below the 55/s offered, so the backlog grows;
    # a worker SIGKILLed and restarted, the node leading input partition 0 SIGKILLed (down 5 s), a
    # second worker joining and leaving, memory sampled throughout.
    scenario_config.model = None  # the stand-in needs no model
    result = await scenarios.saturation_soak(
        scenario_config,
        cluster,
        duration_s=40.0,
        cost_us=20_000.0,
        faults=[("kill", 6.0), ("leader", 12.0), ("join", 22.0), ("leave", 32.0)],
        sample_s=5.0,
        leader_down_s=5.0,
    )
    assert_reconciled(result)
    notes = result.notes
    assert [f["fault"] for f in notes["faults"]] == ["kill", "leader", "join", "leave"], notes["faults"]
    leader = notes["faults"][1]
    assert leader["failover_s"] > 0 and leader["resync_s"] >= 0, leader
    assert notes["faults"][3]["leaver_rc"] == 0, notes["faults"]
    # Saturated: while one worker ran alone, the input outran it (a backlog at the join).
    assert notes["faults"][2]["lag"] > 0, notes["faults"]
    memory = notes["memory"]
    assert memory["samples"] >= 3, memory
    assert any(k.startswith("worker ") for k in memory["rss_mib"]), memory
    assert sum(k.startswith("broker ") for k in memory["rss_mib"]) == 3, memory
