"""Shared by the serve tests (imported by file name, like tests/schemas/schema_strategies.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.engine import Engine
from prism_pipeline.serve.app import AppConfig
from prism_pipeline.serve.metrics import ServeMetrics

API_KEY = "test-key-0123456789"


@dataclass
class Served:
    url: str
    config: AppConfig
    metrics: ServeMetrics
    engine: Engine


def wait_until_engine_is_idle(served: Served, timeout_s: float = 30.0) -> None:
    """Until no /v1/systemone request is being handled and no batch is in the engine (bounded).

    A batch's stats are recorded when its engine call returns, but answers final early (on_ready)
    reach their clients before that. Once nothing is in flight and the engine holds no batch,
    every answered request's batch is in the stats, and no earlier request can still add one.
    """
    deadline = time.monotonic() + timeout_s
    while served.metrics.value("prism_http_in_flight") or served.metrics.value("prism_http_engine_batches"):
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle in {timeout_s} s")
        time.sleep(0.02)


def batch_counts(served: Served) -> tuple[float, float]:
    """(engine batches, requests in them) so far, once the server is idle (see above)."""
    wait_until_engine_is_idle(served)
    return (
        served.metrics.value("prism_http_batch_requests_count"),
        served.metrics.value("prism_http_batch_requests_sum"),
    )
