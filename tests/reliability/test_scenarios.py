"""Bounded fault scenarios against real worker processes and a real broker: nothing lost, nothing
decided two different ways, whatever the fault.

Each runs in well under a minute on 2 cores with the tiny model; all are marked slow (> 20 s).
The workers run the int8 path, which is batch invariant: a redelivered event decided in another
batch must still yield a byte-identical record, so any divergence is a real finding.
"""

from __future__ import annotations

import pytest

from ops.load import scenarios
from ops.load.check import CheckReport
from ops.load.scenarios import ScenarioConfig, ScenarioResult

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(240)]


def assert_reconciled(result: ScenarioResult) -> CheckReport:
    rep = result.check
    detail = result.summary()
    assert rep.inputs == len(result.load.produced) > 0, detail
    assert rep.lost == [] and rep.conflicting == [] and rep.wrong == [] and rep.orphans == 0, detail
    assert rep.divergent == [] and rep.divergent_keys == [], detail
    assert result.worker_exits == {}, detail  # no worker crashed, every graceful stop exited 0
    assert rep.records + rep.dead_letters == rep.inputs + rep.duplicates
    return rep


async def test_worker_sigkilled_mid_load_and_restarted(
    kafka_bootstrap: str, scenario_config: ScenarioConfig
) -> None:
    result = await scenarios.worker_kill(scenario_config, kafka_bootstrap)
    assert_reconciled(result)
    assert result.worker_starts == 2
    assert 0 < result.notes["outcomes_at_kill"] < scenario_config.events, "the kill did not land mid-load"


async def test_one_of_two_workers_leaves_mid_load(
    kafka_bootstrap: str, scenario_config: ScenarioConfig
) -> None:
    result = await scenarios.rebalance(scenario_config, kafka_bootstrap)
    assert_reconciled(result)
    assert result.notes["leaver_rc"] == 0
    assert 0 < result.notes["outcomes_at_leave"] < scenario_config.events


async def test_poison_burst_is_dead_lettered_without_stalling(
    kafka_bootstrap: str, scenario_config: ScenarioConfig
) -> None:
    result = await scenarios.poison_burst(scenario_config, kafka_bootstrap, burst=40)
    rep = assert_reconciled(result)
    poison = [p for p in result.load.produced if p.kind == "poison"]
    assert len(poison) == 40
    # The manifest check (`wrong`) already proved each poison got its own reason; all were letters.
    assert sum(n for r, n in rep.reasons.items() if r.startswith("dead_letter:")) == 40
    assert rep.reasons["record"] == scenario_config.events


async def test_slow_engine_backpressure_bounds_inflight_and_drops_nothing(
    kafka_bootstrap: str, scenario_config: ScenarioConfig
) -> None:
    result = await scenarios.slow_engine(
        scenario_config, kafka_bootstrap, delay_ms=100.0, queued=2, batch=4, poll=8
    )
    assert_reconciled(result)
    n = result.notes
    assert n["samples"] > 5, n
    assert n["pauses"] >= 1, n  # the worker paused fetching
    assert n["max_inflight"] <= n["inflight_bound"], n  # memory held by the worker stays bounded...
    assert n["max_lag"] >= scenario_config.events // 2, n  # ...while the backlog waits in Kafka


async def test_broker_stopped_and_restarted_mid_load(scenario_config: ScenarioConfig) -> None:
    result = await scenarios.broker_restart(scenario_config, scenario_config.workdir, down_s=2.0)
    assert_reconciled(result)
    assert result.worker_starts == 1  # the same worker process reconnected and carried on
    assert 0 < result.notes["outcomes_at_bounce"] < scenario_config.events
