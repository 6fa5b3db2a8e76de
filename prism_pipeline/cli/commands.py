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


# ---- prism run ------------------------------------------------------------------------------------


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
        description="Run one pipeline worker (SIGTERM/SIGINT: drain, publish, commit, exit 0).",
    )
    _add_settings_flags(p)
    p.set_defaults(func=_cmd_run)


# ---- prism demo -----------------------------------------------------------------------------------


TYPE_NAMES = {"noul": "yes/no", "choice": "choice", "score": "score"}  # `noul` is the wire name of yes/no


def _fmt_answer(answer: Any) -> tuple[str, str]:
    """(the answer with the winning option's probability, the other options' probabilities).

    The winner comes first and whole, so a long option list clipped by the table never hides it."""
    if answer.type == "noul":
        p = answer.noul
        return (f"yes {p:.2f}" if p >= 0.5 else f"no {1 - p:.2f}"), f"yes {p:.3f} / no {1 - p:.3f}"
    probs = answer.probabilities
    if answer.type == "choice":
        win = answer.choice
        others = " ".join(f"{k}:{v:.2f}" for k, v in sorted(probs.items(), key=lambda kv: -kv[1]) if k != win)
        return f"{win} {probs[win]:.2f}", others
    mode = max(probs, key=lambda k: probs[k])
    level = answer.legend.get(mode, mode)
    spread = " ".join(f"{k}:{v:.2f}" for k, v in probs.items())
    return f"{answer.score:.2f} ({mode} {probs[mode]:.2f}: {level})", spread


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def render_table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("event", 22),
        ("question", 13),
        ("type", 6),
        ("answer", 34),
        ("probabilities", 44),
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
                    "type": TYPE_NAMES[answer.type],
                    "answer": shown,
                    "probabilities": probs,
                    "thought": f"{trace.thought_tokens} tok" if trace.second is not None else "-",
                }
            )
    w = sys.stdout.write
    w(render_table(rows))
    w(
        "(yes/no is the wire's `noul` question; answer: the winning option and its probability - for a "
        "score the expected level, then the likeliest level; thought: AutoThink's thought tokens, - if "
        "the gate did not fire)\n"
    )
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


# ---- prism eval -----------------------------------------------------------------------------------


def _cmd_eval(args: argparse.Namespace) -> int:
    import orjson

    from prism_pipeline.demo import DemoError, demo_model
    from prism_pipeline.evaluate import EvalError, evaluate, holdout_items, load_items, plot, render_report

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    try:
        model = Path(args.model) if args.model else demo_model(Path(args.cache_dir).resolve())
        if not model.is_file():
            raise EvalError(f"model file not found: {model}")
        if args.set:
            items, name = load_items(Path(args.set)), Path(args.set).name
        else:
            if args.holdout_events < 1:
                raise EvalError("--holdout-events must be >= 1")
            items, name = holdout_items(args.holdout_events), "the synthetic hold-out (seed 1)"

        def progress(path: str, done: int, total: int) -> None:
            sys.stderr.write(f"\r{path}: {done}/{total} events decided")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()

        report = evaluate(
            model,
            items,
            paths,
            set_name=name,
            gate=args.gate,
            thought_budget=args.thought_budget,
            progress=progress,
            batch_events=args.batch_events,
        )
    except (EvalError, DemoError) as e:
        sys.stderr.write(f"prism eval: {e}\n")
        return 2
    sys.stdout.write(render_report(report))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_bytes(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2) + b"\n")
    plot(report, out / "eval.png")
    sys.stdout.write(f"wrote {out / 'eval.json'} and {out / 'eval.png'}\n")
    return 0


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="score a model on labelled questions per precision path (accuracy, calibration, cross-read)",
        description=(
            "Decide a labelled JSONL set (default: the synthetic generator's hold-out) on each precision "
            "path; print and write accuracy per question type, calibration (ECE, reliability diagram), "
            "agreement between paths, the AutoThink gate, thought lengths and the cross-read matrix "
            "(thoughts written by one path, read by another). A labelled line is an evidence event plus "
            '"labels": {question id: right option id} (noul, a yes/no question: "yes"/"no"; '
            'score: the level index "0".."n-1").'
        ),
    )
    p.add_argument(
        "--model", metavar="MODEL.gguf", help="the model to score (default: the bundled trained demo model)"
    )
    p.add_argument(
        "--set", metavar="LABELLED.jsonl", help="labelled events (default: the generator's hold-out, seed 1)"
    )
    p.add_argument(
        "--holdout-events",
        type=int,
        default=300,
        metavar="N",
        help="events of the generated hold-out when no --set is given (default 300, about 1,000 questions)",
    )
    p.add_argument(
        "--paths",
        default="fp32,int8",
        metavar="P1,P2",
        help="comma-separated precision paths among fp32, int8, bf16 (default fp32,int8)",
    )
    p.add_argument(
        "--gate", type=float, default=None, metavar="P", help="AutoThink gate (default: the model's config)"
    )
    p.add_argument(
        "--thought-budget",
        type=int,
        default=None,
        metavar="TOKENS",
        help="AutoThink thought budget in tokens (default: the model's config)",
    )
    p.add_argument(
        "--batch-events", type=int, default=64, metavar="N", help="events per engine call (default 64)"
    )
    p.add_argument(
        "--out", default="eval-out", metavar="DIR", help="where eval.json and eval.png go (default eval-out)"
    )
    p.add_argument(
        "--cache-dir", default=".cache", metavar="DIR", help="cache of generated models (default .cache)"
    )
    p.set_defaults(func=_cmd_eval)
