"""`prism run --tp 2` (two gloo ranks on CPU) publishes the same record bytes as `prism run`.

Oracle: a single-process int8 worker reading the same input topic; every decision record's
value (answers, both read-outs, thoughts, provenance) must be byte-identical, key by key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from worker_runs import WorkerTopics, run_worker_until

from tests.pipeline.kafkautil import Tail, create_topics, encode, event, produce, unique

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


async def test_tp2_worker_publishes_the_bytes_of_one_process(
    kafka_bootstrap: str, worker_args: list[str], tmp_path: Path
) -> None:
    tin = unique("in")
    outs = {1: unique("out-tp1"), 2: unique("out-tp2")}
    await create_topics(kafka_bootstrap, {tin: 2, outs[1]: 1, outs[2]: 1})
    n = 10
    events = [event(i, prefix="tp") for i in range(n)]
    for i in (2, 7):
        events[i]["gate"] = 1.0  # these think (3 tokens), then read again
    await produce(kafka_bootstrap, tin, [(None, encode(e), i % 2) for i, e in enumerate(events)])
    int8_args = [a if a != "fp32" else "int8" for a in worker_args]
    assert "int8" in int8_args
    values = {}
    for tp, tout in outs.items():
        args = [*int8_args, "--tp", str(tp)]
        values[tp] = await _records(kafka_bootstrap, args, tin, tout, n, tmp_path / f"tp{tp}.log")
    assert '"tp_group_ready"' in (tmp_path / "tp2.log").read_text()
    assert len(values[1]) == n
    assert values[2] == values[1]


async def _records(
    bootstrap: str, worker_args: list[str], tin: str, tout: str, n: int, log_path: Path
) -> dict[bytes, bytes]:
    """Run one worker until it published n records; its records as key -> value."""
    topics = WorkerTopics(bootstrap, tin, tout, dead_letters=unique("dlq"), group=unique("g"))
    async with Tail(bootstrap, [tout]) as out:
        code = await run_worker_until(
            [*worker_args, *topics.worker_args()],
            log_path,
            lambda: len(out.messages) >= n,
            240,
            "records",
            stop_timeout=120,
        )
        assert code == 0, log_path.read_text()[-3000:]
        return {m.key: m.value for m in out.messages}
