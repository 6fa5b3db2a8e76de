"""`prism run` with a slowed engine, for the backpressure scenario:

    python -m ops.load.slow_worker --log-json run --engine-delay-ms 300 <prism run flags>

The worker itself is unchanged: the engine it is given sleeps before each `decide` call (per
event in the batch), emulating an accelerator that cannot keep up with the input rate.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from engine.types import DecideRequest, DecideResult
from ops.load.worker_main import run_with_engine
from prism_pipeline.worker.settings import WorkerSettings


class SlowEngine:
    """Forwards everything to `inner`; `decide` first sleeps `delay_s` per request."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def decide(self, requests: list[DecideRequest]) -> list[DecideResult]:
        time.sleep(self._delay_s * len(requests))
        return self._inner.decide(requests)


def main(argv: list[str] | None = None) -> int:
    from prism_pipeline.core.engine_setup import load_engine

    def add_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--engine-delay-ms", type=float, default=0.0)

    def make_engine(known: argparse.Namespace, settings: WorkerSettings) -> SlowEngine:
        return SlowEngine(load_engine(settings), known.engine_delay_ms / 1000.0)

    return run_with_engine(argv, "slow_worker", add_args, make_engine)


if __name__ == "__main__":
    sys.exit(main())
