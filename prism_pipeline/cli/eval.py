"""`prism eval`: the flags, and the report's terminal table and PNG (`evaluate` computes it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prism_pipeline.evaluate import EvalReport


def _cmd_eval(args: argparse.Namespace) -> int:
    import orjson

    from prism_pipeline.demo import DemoError, demo_model
    from prism_pipeline.evaluate import EvalError, evaluate, holdout_items, load_items

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


def plot(report: EvalReport, out: Path) -> Path:
    """Reliability diagram per path, and the cross-read matrix, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = list(report.paths)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfectly calibrated")
    for p in paths:
        pts = [(b["confidence"], b["accuracy"]) for b in report.paths[p]["calibration"]["bins"] if b["count"]]
        ece = report.paths[p]["calibration"]["ece"]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{p} (ECE {ece:.3f})")
    ax.set_xlabel("confidence (top probability)")
    ax.set_ylabel("accuracy")
    ax.set_title("reliability")
    ax.legend(loc="upper left", fontsize=8)
    grid = [[report.cross_read[w][r]["accuracy"] or 0.0 for r in paths] for w in paths]
    im = bx.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis")
    for i, w in enumerate(paths):
        for j, r in enumerate(paths):
            cell = report.cross_read[w][r]
            bx.text(j, i, f"{cell['correct']}/{cell['thoughts']}", ha="center", va="center", color="white")
    bx.set_xticks(range(len(paths)), [f"read by {p}" for p in paths])
    bx.set_yticks(range(len(paths)), [f"written by {p}" for p in paths])
    bx.set_title("cross-read: correct / thoughts")
    fig.colorbar(im, ax=bx, fraction=0.046)
    fig.suptitle(f"{Path(report.model).name} on {report.set_name} ({report.events} events)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def render_report(report: EvalReport) -> str:
    """The terminal summary of a report."""
    paths = list(report.paths)
    lines = [f"{report.events} events, {next(iter(report.paths.values()))['questions']} labelled questions"]
    lines.append(
        "path   accuracy  first   noul    choice  score   ECE     gate fired  before->after  "
        "thought p50/p99  unclosed"
    )
    for p in paths:
        s = report.paths[p]
        t = s["by_type"]
        g = s["gate"]

        def pct(x: float | None) -> str:
            return "   -  " if x is None else f"{100 * x:5.1f}%"

        ba = f"{pct(g['accuracy_before'])}->{pct(g['accuracy_after'])}" if g["fired"] else "-"
        th = s["thoughts"]
        lengths = f"{th['p50_tokens']:.0f}/{th['p99_tokens']:.0f}" if th["p50_tokens"] is not None else "-"
        lines.append(
            f"{p:<6} {pct(s['accuracy'])}    {pct(s['first_accuracy'])}  "
            + "  ".join(pct(t[k]["accuracy"]) if k in t else "   -  " for k in ("noul", "choice", "score"))
            + f"  {s['calibration']['ece']:.4f}  {g['fired']:>4} ({100 * g['share']:4.1f}%)  {ba:<14} "
            f"{lengths:<16} {th['unclosed']}"
        )
    for pair, ag in report.agreement.items():
        lines.append(
            f"agreement {pair}: {100 * ag['agree']:.2f}% same answer, "
            f"largest probability difference {ag['max_abs_probability_diff']:.4f}"
        )
    lines.append("cross-read (rows: thoughts written by; columns: read by) correct/thoughts:")
    lines.append("          " + "".join(f"{r:>18}" for r in paths))
    for w in paths:
        cells = []
        for r in paths:
            c = report.cross_read[w][r]
            cells.append(f"{c['correct']}/{c['thoughts']}".rjust(18))
        lines.append(f"{w:<10}" + "".join(cells))
    for w in paths:
        for r in paths:
            c = report.cross_read[w][r]
            if w != r and c["reader_also_thought"]:
                lines.append(
                    f"thoughts of {w} that differ from {r}'s own on the same question: "
                    f"{c['differ_from_reader_thought']}/{c['reader_also_thought']}"
                )
    return "\n".join(lines) + "\n"
