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
    from prism_pipeline.cli import build_parser
    from prism_pipeline.cli.run import settings_from_args
    from prism_pipeline.core.engine_setup import ConfigError, load_engine
    from prism_pipeline.logs import configure_logging, install_stack_dump
    from prism_pipeline.worker.runner import run_worker

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine-delay-ms", type=float, default=0.0)
    known, rest = pre.parse_known_args(argv)
    args = build_parser().parse_args(rest)
    if args.command != "run":
        sys.stderr.write("slow_worker: only the `run` command is supported\n")
        return 2
    configure_logging(args.log_level, args.log_json)
    install_stack_dump()
    try:
        settings = settings_from_args(args)
        engine = SlowEngine(load_engine(settings), known.engine_delay_ms / 1000.0)
    except (ConfigError, ValueError) as e:
        sys.stderr.write(f"slow_worker: {e}\n")
        return 2
    return run_worker(settings, engine)


if __name__ == "__main__":
    sys.exit(main())
