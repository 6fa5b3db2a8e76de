"""Hostile input through a real worker: each case gets its outcome, none crashes or stalls the
worker, and a control event's decision is the same alone and among the hostile cases.

The worker runs the int8 path (batch invariant by contract), so "the same" means byte-identical
decision content; the fp32 path would need one event per batch to promise that.
"""

from __future__ import annotations

import base64

import orjson
import pytest

from ops.load import scenarios
from ops.load.scenarios import ScenarioConfig
from prism_pipeline.core.records import MAX_DEAD_LETTER_ORIGINAL_BYTES
from tests.pipeline.kafkautil import read_all

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(240)]


async def test_hostile_input_gets_clear_outcomes_and_leaves_the_control_unchanged(
    kafka_bootstrap: str, scenario_config: ScenarioConfig
) -> None:
    scenario_config.partitions = 1  # the control shares batches with its hostile neighbours
    result = await scenarios.hostile(scenario_config, kafka_bootstrap)
    rep = result.check
    detail = result.summary()
    # Every case's outcome is the one the contract names (`wrong` compares against the manifest).
    assert rep.inputs == len(result.load.produced) and rep.lost == [] and rep.wrong == [], detail
    assert rep.conflicting == [] and rep.divergent == [] and rep.orphans == 0, detail
    assert result.worker_exits == {} and result.worker_starts == 1, detail
    # The two control records (alone, then among the cases) share a key; the checker compares their
    # decision content byte for byte: no divergent key means the neighbours changed nothing.
    assert rep.divergent_keys == [], detail
    assert rep.reasons["record"] == 7 and rep.dead_letters == 10, detail
    # ...and the second control really was decided in one engine batch with hostile events.
    _, tout, _ = result.notes["topics"]
    out = await read_all(kafka_bootstrap, [tout], rep.records, settle=0.2)
    controls = sorted((m for m in out if m.key.endswith(b"-control")), key=lambda m: m.offset)
    assert len(controls) == 2
    batch_sizes = [int(dict(m.headers)["prism-batch-events"]) for m in controls]
    assert batch_sizes[0] == 1 and batch_sizes[1] > 1, batch_sizes


async def test_a_10mb_poison_message_is_dead_lettered_with_a_truncated_original(
    kafka_bootstrap: str, scenario_config: ScenarioConfig
) -> None:
    # Regression: the dead letter used to carry the whole 10 MB original (13 MB of base64), over
    # the producer's 1 MiB cap, and the worker failed on it, again after every restart.
    from ops.load.events import hostile_cases

    big = next(m for m in hostile_cases("big") if m.label == "payload_10mb")
    result = await _run_messages(kafka_bootstrap, scenario_config, [big])
    assert result.check.ok and result.worker_exits == {}, result.summary()
    (msg,) = await read_all(kafka_bootstrap, [result.notes["topics"][2]], 1, settle=0.2)
    letter = orjson.loads(msg.value)
    assert letter["reason"] == "oversized_state"
    assert letter["original_size"] == len(big.value)
    assert base64.b64decode(letter["original_b64"]) == big.value[:MAX_DEAD_LETTER_ORIGINAL_BYTES]


async def _run_messages(bootstrap: str, cfg: ScenarioConfig, messages: list) -> scenarios.ScenarioResult:
    from ops.load.generate import generate

    async with scenarios.Pipeline(cfg, bootstrap, "messages") as p:
        p.worker("w")
        load = await generate(bootstrap, p.input_topic, messages=messages)
        return await p.finish(load)
