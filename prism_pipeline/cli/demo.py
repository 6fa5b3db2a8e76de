"""`prism demo`: the flags, and the decision table it prints (the only pipeline code that writes to
stdout is under cli/)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from prism_pipeline.cli.engine_flags import add_engine_flags

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
    add_engine_flags(
        p,
        model_help="a StartLux-Decision GGUF (default: the bundled trained demo model)",
        required=False,
        files=False,
        tp=False,
    )
    p.add_argument("--events", help="JSON-lines evidence events (default: the bundled samples)")
    p.add_argument(
        "--cache-dir", default=".cache", help="where the generated demo model is kept (default .cache)"
    )
    p.add_argument("--limit", type=int, default=None, help="use only the first N events")
    p.set_defaults(func=_cmd_demo)
