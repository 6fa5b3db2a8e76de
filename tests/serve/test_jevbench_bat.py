"""JevBench's BAT relations (batch independence) against `prism serve`, through its real CLI.

BAT asks each question alone, reordered, duplicated, among other companions and in batches of 2, 5
and 10, and compares its probabilities with the full request's. jevbench 0.1.0 has no `bat` alias
for `--relations`, so the five BAT.isolation relations are named.

jevbench sends at most one request per listed URL at a time (`per_replica=1`), so the server's URL
is listed 8 times: with `--concurrency 8` eight requests are then in flight and the server really
batches them (checked on /metrics).
- int8 (the batch-invariant path): `--noise-floor 0`, i.e. zero tolerance: every probability must be
  bit-for-bit the same whatever the companions and the batch.
- fp32 (not batch invariant: forests of different shapes round differently): jevbench's own
  tolerance (TV 0.05).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_bat_cases import write_cases
from serve_helpers import Served, wait_until_engine_is_idle

from engine.engine import Engine
from prism_pipeline.serve.app import AppConfig, create_app
from prism_pipeline.serve.metrics import ServeMetrics
from prism_pipeline.serve.server import ServerThread

RELATIONS = "batch_solo,batch_order,duplicate_question,batch_content,batch_size_sweep"
JEVBENCH = [sys.executable, "-c", "from jevbench.cli import main; main()"]

pytestmark = pytest.mark.slow


def jevbench_bat(served: Served, tmp: Path, *extra: str, max_cases: int = 3) -> dict:
    url = f"{served.url}/v1/systemone"
    out = tmp / "bat.json"
    cmd = [
        *JEVBENCH, "run", "--cases", str(write_cases(tmp / "cases.jsonl")),
        "--backend", f"systemone:{served.engine.model_name}", "--url", ",".join([url] * 8),
        "--relations", RELATIONS, "--concurrency", "8", "--no-cache", "--max-cases", str(max_cases),
        "--out", str(out), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BAT.isolation" in proc.stdout
    return json.loads(out.read_text())


def check(result: dict, served: Served, before: tuple[float, float]) -> list[float]:
    assert result["errors"] == [] and not result["backend_down"]
    outcomes = result["outcomes"]
    assert {o["relation"] for o in outcomes} == set(RELATIONS.split(","))
    assert [o for o in outcomes if o["violated"]] == []
    wait_until_engine_is_idle(served)  # the last batch's stats are recorded after its answers
    batches = served.metrics.value("prism_http_batch_requests_count") - before[0]
    requests = served.metrics.value("prism_http_batch_requests_sum") - before[1]
    assert requests == result["requests"] > 0
    assert batches < requests, "eight requests in flight should share engine batches"
    return [o["deviation"] for o in outcomes]


def _counts(served: Served) -> tuple[float, float]:
    wait_until_engine_is_idle(served)  # an earlier test's last batch must not land in the window
    return (
        served.metrics.value("prism_http_batch_requests_count"),
        served.metrics.value("prism_http_batch_requests_sum"),
    )


@pytest.fixture(scope="module")
def int8_server(model_path: Path) -> Iterator[Served]:
    engine = Engine.load(model_path, precision="int8")
    config = AppConfig(max_wait_ms=5.0, gate=0.0)
    metrics = ServeMetrics()
    with ServerThread(create_app(engine, config, metrics)) as url:
        yield Served(url, config, metrics, engine)


def test_bat_int8_is_bit_exact(int8_server: Served, tmp_path: Path) -> None:
    before = _counts(int8_server)
    result = jevbench_bat(int8_server, tmp_path, "--noise-floor", "0")
    assert result["noise_floor"] == 0
    assert max(check(result, int8_server, before)) == 0.0


def test_bat_fp32_within_jevbench_tolerance(open_server: Served, tmp_path: Path) -> None:
    before = _counts(open_server)
    deviations = check(jevbench_bat(open_server, tmp_path), open_server, before)
    assert max(deviations) < 1e-6  # fp32 rounding only, far inside jevbench's 0.05
