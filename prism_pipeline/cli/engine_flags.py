"""The flags that load an engine, one definition for `serve`, `backfill` and `demo` (`prism run`
gets them from `WorkerSettings`, which extends the same `EngineSettings`): their help comes from
the settings model, so a flag says the same under every command."""

from __future__ import annotations

import argparse
from pathlib import Path

from prism_pipeline.cli.helptext import METAVARS
from prism_pipeline.core.engine_setup import PRECISIONS, EngineSettings

_FIELDS = EngineSettings.model_fields


def _help(name: str) -> str:
    return _FIELDS[name].description or ""


def _shown(name: str) -> str:
    return METAVARS.get(name, name.upper())


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def unit_float(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def add_engine_flags(
    p: argparse.ArgumentParser,
    *,
    model_help: str | None = None,
    required: bool = True,
    files: bool = True,
    tp: bool = True,
) -> None:
    """--model, --device, --precision, --gate, --thought-budget; with `files` also --mmproj and
    --decision-config; with `tp` also --tp."""
    p.add_argument("--model", required=required, metavar=_shown("model"), help=model_help or _help("model"))
    if files:
        p.add_argument("--mmproj", type=Path, default=None, metavar=_shown("mmproj"), help=_help("mmproj"))
        p.add_argument(
            "--decision-config",
            default=None,
            metavar=_shown("decision_config"),
            help=_help("decision_config"),
        )
    p.add_argument(
        "--device", default="cpu", metavar=_shown("device"), help=f"{_help('device')} (default cpu)"
    )
    p.add_argument("--precision", default="auto", choices=PRECISIONS, help=_help("precision"))
    if tp:
        p.add_argument("--tp", type=positive_int, default=1, metavar=_shown("tp"), help=_help("tp"))
    p.add_argument("--gate", type=unit_float, default=None, metavar=_shown("gate"), help=_help("gate"))
    p.add_argument(
        "--thought-budget",
        type=int,
        default=None,
        metavar=_shown("thought_budget"),
        help=_help("thought_budget"),
    )


def engine_settings(args: argparse.Namespace, model: Path | None = None) -> EngineSettings:
    """The engine settings the flags of `add_engine_flags` name (ValueError when one cannot work)."""
    return EngineSettings(
        model=model if model is not None else args.model,
        mmproj=getattr(args, "mmproj", None),  # None: an mmproj-*.gguf beside the model, or none
        decision_config=getattr(args, "decision_config", None),
        device=args.device,
        precision=args.precision,
        tp=getattr(args, "tp", 1),
        gate=args.gate,
        thought_budget=args.thought_budget,
    )
