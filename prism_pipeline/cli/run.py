"""`prism run`: one flag per `WorkerSettings` field (unset flags fall back to `PRISM_*` variables,
then defaults), and the worker started from them."""

from __future__ import annotations

import argparse
import sys
import typing
from typing import Any

from pydantic import ValidationError

from prism_pipeline.worker.settings import WorkerSettings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_settings_flags(p: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """One flag per WorkerSettings field; unset flags fall back to PRISM_* variables, then defaults.

    Placeholders come from `prism_pipeline.helptext.METAVARS`; the description from the field."""
    from prism_pipeline.cli.helptext import METAVARS

    for name, field in WorkerSettings.model_fields.items():
        if name in skip:
            continue
        env = f"PRISM_{name.upper()}"
        ann = field.annotation
        args = typing.get_args(ann)
        desc = field.description or ""
        if ann is bool:
            p.add_argument(_flag(name), action="store_true", default=None, help=f"{desc} [{env}]".strip())
            continue
        choices = None
        literal = next((a for a in (ann, *args) if typing.get_origin(a) is typing.Literal), None)
        if literal is not None:
            choices = typing.get_args(literal)
        default = None if field.default_factory is not None else field.default
        shown = "unset" if default is None else default
        help_text = f"{desc} [{env}; default {shown}]".strip()
        p.add_argument(
            _flag(name),
            dest=name,
            default=None,
            choices=choices,
            metavar=None if choices else METAVARS.get(name, name.upper()),
            help=help_text,
        )


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> WorkerSettings:
    given = {k: v for k, v in vars(args).items() if k in WorkerSettings.model_fields and v is not None}
    given.update(overrides)
    return WorkerSettings(**given)


def _settings_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "settings"
        lines.append(f"  {_flag(loc) if loc in WorkerSettings.model_fields else loc}: {err['msg']}")
    return "invalid configuration:\n" + "\n".join(lines) + "\n"


def _cmd_run(args: argparse.Namespace) -> int:
    from prism_pipeline.core.engine_setup import ConfigError
    from prism_pipeline.worker.runner import run_worker

    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        sys.stderr.write(_settings_error(e))
        return 2
    try:
        return run_worker(settings)
    except ConfigError as e:
        sys.stderr.write(f"prism run: {e}\n")
        return 2


def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="consume evidence events from Kafka and publish decision records",
        description="Run one pipeline worker. SIGTERM/SIGINT: drain, publish, commit, exit 0; a "
        "drain not done within --stop-timeout-s abandons its in-flight work uncommitted (the "
        "partitions' next owner decides it again) and exits 3; 1 means the worker failed. "
        "SIGUSR1 logs every asyncio task's await chain and every thread's stack.",
    )
    _add_settings_flags(p)
    p.set_defaults(func=_cmd_run)
