"""The pipeline's subcommands (`prism run`, `prism demo`): argument parsing and terminal output.

This is CLI code: it is the only pipeline module that writes to stdout.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from prism_pipeline.settings import WorkerSettings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_settings_flags(p: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """One flag per WorkerSettings field; unset flags fall back to PRISM_* variables, then defaults."""
    for name, field in WorkerSettings.model_fields.items():
        if name in skip:
            continue
        env = f"PRISM_{name.upper()}"
        ann = field.annotation
        args = typing.get_args(ann)
        if ann is bool:
            p.add_argument(_flag(name), action="store_true", default=None, help=f"[{env}]")
            continue
        choices = None
        literal = next((a for a in (ann, *args) if typing.get_origin(a) is typing.Literal), None)
        if literal is not None:
            choices = typing.get_args(literal)
        default = None if field.default_factory is not None else field.default
        desc = field.description or ""
        help_text = f"{desc} [{env}; default {default}]".strip()
        p.add_argument(
            _flag(name),
            dest=name,
            default=None,
            choices=choices,
            metavar=None if choices else "V",
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


# ---- prism run ------------------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    from prism_pipeline.runner import ConfigError, run_worker

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
        description="Run one pipeline worker (SIGTERM/SIGINT: drain, publish, commit, exit 0).",
    )
    _add_settings_flags(p)
    p.set_defaults(func=_cmd_run)


# ---- prism demo -----------------------------------------------------------------------------------


def _fmt_answer(answer: Any) -> tuple[str, str]:
    if answer.type == "noul":
        return f"yes={answer.noul:.3f}", f"yes {answer.noul:.3f} / no {1 - answer.noul:.3f}"
    probs = " ".join(f"{k}:{v:.2f}" for k, v in answer.probabilities.items())
    if answer.type == "choice":
        return answer.choice, probs
    return f"{answer.score:.2f}", probs


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def render_table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("event", 22),
        ("question", 13),
        ("type", 6),
        ("answer", 16),
        ("probabilities", 58),
        ("thought", 7),
    ]
    out = ["  ".join(name.ljust(w) for name, w in cols), "  ".join("-" * w for _, w in cols)]
    for r in rows:
        out.append("  ".join(_clip(str(r[name]), w).ljust(w) for name, w in cols))
    return "\n".join(out) + "\n"


def _cmd_demo(args: argparse.Namespace) -> int:
    from prism_pipeline.demo import DemoError, run_demo

    try:
        result = run_demo(
            model=Path(args.model) if args.model else None,
            events=Path(args.events) if args.events else None,
            cache_dir=Path(args.cache_dir),
            device=args.device,
            precision=args.precision,
            limit=args.limit,
            gate=args.gate,
            thought_budget=args.thought_budget,
        )
    except DemoError as e:
        sys.stderr.write(f"prism demo: {e}\n")
        return 1
    rows = []
    for rec in result.records:
        for qid, answer in rec.answers.items():
            shown, probs = _fmt_answer(answer)
            trace = rec.questions[qid]
            rows.append(
                {
                    "event": rec.event_id,
                    "question": qid,
                    "type": answer.type,
                    "answer": shown,
                    "probabilities": probs,
                    "thought": "yes" if trace.second is not None else "no",
                }
            )
    w = sys.stdout.write
    w(render_table(rows))
    w(
        f"\n{result.events} events, {len(result.records)} decision records, "
        f"{result.dead_letters} dead letters, "
        f"{sum(len(r.answers) for r in result.records)} answers in {result.pipeline_seconds:.1f} s "
        f"(model {result.model_name}, {result.precision}, digest {result.model_digest[:12]}…)\n"
    )
    if result.replay_mismatches:
        w(
            f"REPLAY CHECK FAILED: {len(result.replay_mismatches)} record(s) differ: "
            f"{', '.join(result.replay_mismatches[:10])}\n"
        )
        return 1
    w(f"replay check: all {len(result.records)} records re-decided byte for byte identical\n")
    return 0


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="end-to-end demo: local Kafka, sample alerts and tickets, a worker, a decision table",
        description=(
            "Start a local Kafka broker, publish the bundled sample events, decide them with a worker, "
            "print the decisions, verify them by re-deciding, and shut everything down."
        ),
    )
    p.add_argument("--model", help="a StartLux-Decision GGUF (default: generate a small demo model)")
    p.add_argument("--events", help="JSON-lines evidence events (default: the bundled samples)")
    p.add_argument(
        "--cache-dir", default=".cache", help="where the generated demo model is kept (default .cache)"
    )
    p.add_argument("--device", default="cpu", help="engine device (default cpu)")
    p.add_argument("--precision", default="auto", choices=["auto", "int8", "bf16", "fp32"])
    p.add_argument("--limit", type=int, default=None, help="use only the first N events")
    p.add_argument("--gate", type=float, default=None, help="AutoThink gate (default: the model's config)")
    p.add_argument(
        "--thought-budget",
        type=int,
        default=None,
        help="AutoThink budget in tokens (default: the model's config; 8 for the generated demo model)",
    )
    p.set_defaults(func=_cmd_demo)
