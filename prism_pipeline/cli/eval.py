"""`prism eval`: the flags, and where the report goes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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
