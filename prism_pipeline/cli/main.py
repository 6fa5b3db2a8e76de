"""The `prism` command line. Subcommands register themselves in `COMMANDS`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from prism_pipeline.cli.backfill import add_backfill
from prism_pipeline.cli.demo import add_demo
from prism_pipeline.cli.eval import add_eval
from prism_pipeline.cli.helptext import polish
from prism_pipeline.cli.replay import add_replay
from prism_pipeline.cli.run import add_run
from prism_pipeline.cli.serve import add_serve
from prism_pipeline.logs import configure_logging, install_stack_dump


def package_version() -> str:
    try:
        return version("prism")
    except PackageNotFoundError:
        return "0+unknown"


def version_lines() -> list[str]:
    """What each version number versions. Records carry the engine and render versions (what a
    decision depends on); the package version names the release of the CLI and pipeline code."""
    import torch

    from engine.engine import ENGINE_VERSION
    from engine.model.prompt import RENDER_VERSION

    return [
        f"prism {package_version()}  (the package: CLI and pipeline)",
        f"engine {ENGINE_VERSION}  (model.engine_version in every decision record; moves when decisions can)",
        f"prompt {RENDER_VERSION}  (model.render_version in every decision record)",
        f"torch {torch.__version__}",
    ]


def _cmd_version(args: argparse.Namespace) -> int:
    sys.stdout.write("\n".join(version_lines()) + "\n")
    return 0


def _add_version(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("version", help="print the package, engine (as in records) and prompt-render versions")
    p.set_defaults(func=_cmd_version)


# Each entry adds one subcommand parser; later modules append their own.
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_version,
    add_run,
    add_demo,
    add_serve,
    add_replay,
    add_backfill,
    add_eval,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prism",
        description="Prism: fast, exact typed decisions with StartLux-Decision models, from Kafka events.",
    )
    parser.add_argument("--log-level", default="INFO", help="log level (default INFO)")
    parser.add_argument("--log-json", action="store_true", default=None, help="force JSON log lines")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    polish(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    configure_logging(args.log_level, args.log_json)
    install_stack_dump()
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
