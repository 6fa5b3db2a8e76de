"""`prism run` with a harness engine: the one entry point `ops.load.slow_worker` (the tiny model,
slowed) and `ops.load.standin_engine` (an engine stand-in of declared cost) share.

The worker is the real one (`prism run`'s parser, settings and `run_worker`); only the engine it
is handed differs, built by `make_engine` from the harness's own flags, which are parsed off the
command line first so `prism run` never sees them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from prism_pipeline.core.records import DecisionEngine
from prism_pipeline.worker.settings import WorkerSettings


def run_with_engine(
    argv: list[str] | None,
    prog: str,
    add_args: Callable[[argparse.ArgumentParser], Any],
    make_engine: Callable[[argparse.Namespace, WorkerSettings], DecisionEngine],
    around: Callable[[argparse.Namespace, Callable[[], int]], int] | None = None,
) -> int:
    """Parse the harness flags (`add_args`), then `prism ... run` flags; run the worker on the
    engine `make_engine` builds (inside `around`, when given: e.g. under a profiler)."""
    from prism_pipeline.cli import build_parser
    from prism_pipeline.cli.run import settings_from_args
    from prism_pipeline.logs import configure_logging, install_stack_dump
    from prism_pipeline.worker.runner import run_worker

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    add_args(pre)
    known, rest = pre.parse_known_args(argv)
    args = build_parser().parse_args(rest)
    if args.command != "run":
        sys.stderr.write(f"{prog}: only the `run` command is supported\n")
        return 2
    configure_logging(args.log_level, args.log_json)
    install_stack_dump()
    try:
        settings = settings_from_args(args)
        engine = make_engine(known, settings)
    except ValueError as e:  # ConfigError and pydantic's ValidationError are ValueErrors
        sys.stderr.write(f"{prog}: {e}\n")
        return 2

    def run() -> int:
        return run_worker(settings, engine)

    return run() if around is None else around(known, run)
