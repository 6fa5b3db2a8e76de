"""The seed-style benchmark chart from a `bench_engine.py` JSON, as a PNG.

Left: latency of workloads (a)-(c) normalized to the peer (HF transformers bf16, run in the same
process by `bench_engine.py --peer`) = 1, each bar labelled with its real milliseconds (mean).
Right: workload (d), read-out requests per second. Lower is better on the left, higher on the
right. A JSON without a peer is normalized to its first variant, and the axis says so.

    python ops/bench/plot.py out.json --out ops/bench/chart_27B.png [--title "27B, H200"]

`chart_data` (no matplotlib) turns the JSON into the numbers drawn; `draw` needs matplotlib
(the GPU image has it; on a dev machine without it, only `chart_data` runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LATENCY = [
    ("a_one_question_256", "(a) 1 question\n~256 tok"),
    ("b_three_questions_256", "(b) 3 questions\nshared evidence"),
    ("b_readme_three_questions", "(b) README's\n3 questions"),
    ("c_one_question_8192", "(c) 1 question\n~8,192 tok"),
]
THROUGHPUT = ("d_64_clients_req_per_s", "(d) 64 clients\nread-outs")
PEER = "peer"


@dataclass
class ChartData:
    """What the chart draws: per engine (variants in JSON order, then the peer) and workload,
    the latency relative to the baseline and the real ms; per engine the requests/s."""

    baseline: str  # the engine whose latency is 1
    engines: list[str] = field(default_factory=list)
    workloads: list[str] = field(default_factory=list)  # labels of the latency workloads drawn
    relative: dict[str, list[float | None]] = field(default_factory=dict)
    ms: dict[str, list[float | None]] = field(default_factory=dict)
    req_per_s: dict[str, float | None] = field(default_factory=dict)
    shape: str = ""
    device: str = ""


def _runs(doc: dict[str, Any]) -> tuple[dict[str, dict], dict | None]:
    """(variant name -> result, peer result or None) from either JSON layout bench_engine writes:
    one result (the peer nested in it) or {variant: result, "peer": ...} (--variants)."""
    if "variant" in doc:
        return {doc["variant"]: doc}, doc.get(PEER)
    runs = {k: v for k, v in doc.items() if isinstance(v, dict) and "variant" in v}
    if not runs:
        raise ValueError("no bench_engine results in this JSON (expected 'variant' keys)")
    return runs, doc.get(PEER)


def _mean(run: dict, key: str) -> float | None:
    value = run.get(key)
    return float(value["mean_ms"]) if isinstance(value, dict) and "mean_ms" in value else None


def chart_data(doc: dict[str, Any]) -> ChartData:
    runs, peer = _runs(doc)
    engines = dict(runs)
    if peer is not None:
        engines[PEER] = peer
    baseline = PEER if peer is not None else next(iter(runs))
    keys = [(k, label) for k, label in LATENCY if any(_mean(r, k) is not None for r in engines.values())]
    first = next(iter(runs.values()))
    data = ChartData(
        baseline=baseline,
        workloads=[label for _, label in keys],
        shape=str(first.get("shape", "")),
        device=str(first.get("device", "")),
    )
    for name, run in engines.items():
        data.engines.append(name)
        ms = [_mean(run, k) for k, _ in keys]
        base = [_mean(engines[baseline], k) for k, _ in keys]
        data.ms[name] = ms
        data.relative[name] = [m / b if m is not None and b else None for m, b in zip(ms, base, strict=True)]
        rps = run.get(THROUGHPUT[0])
        data.req_per_s[name] = float(rps) if isinstance(rps, int | float) else None
    return data


def _label(name: str) -> str:
    return "transformers bf16 (peer)" if name == PEER else f"Prism {name}"


def draw(data: ChartData, out: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on the GPU machine or in CI
    import matplotlib.pyplot as plt

    n = len(data.engines)
    width = 0.8 / max(n, 1)
    colors = plt.get_cmap("tab10").colors
    has_rps = any(v is not None for v in data.req_per_s.values())
    fig, axes = plt.subplots(
        1, 2 if has_rps else 1, figsize=(11 if has_rps else 8, 4.6),
        gridspec_kw={"width_ratios": [3, 1]} if has_rps else None,
    )  # fmt: skip
    left = axes[0] if has_rps else axes
    for i, name in enumerate(data.engines):
        xs = [w + (i - (n - 1) / 2) * width for w in range(len(data.workloads))]
        heights = [r if r is not None else 0.0 for r in data.relative[name]]
        bars = left.bar(xs, heights, width, label=_label(name), color=colors[i % len(colors)])
        for bar, ms in zip(bars, data.ms[name], strict=True):
            if ms is not None:
                text = f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"
                left.annotate(
                    text, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points",
                )  # fmt: skip
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    left.set_xticks(range(len(data.workloads)), data.workloads, fontsize=8)
    left.set_ylabel(f"latency, {_label(data.baseline)} = 1 (labels: ms, mean)")
    left.legend(fontsize=7, loc="upper left")
    if has_rps:
        right = axes[1]
        names = [e for e in data.engines if data.req_per_s[e] is not None]
        values = [data.req_per_s[e] or 0.0 for e in names]
        bars = right.bar(
            range(len(names)), values, color=[colors[data.engines.index(e) % len(colors)] for e in names]
        )
        for bar, v in zip(bars, values, strict=True):
            right.annotate(
                f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points",
            )  # fmt: skip
        short = ["transformers" if e == PEER else e for e in names]
        right.set_xticks(range(len(names)), short, fontsize=7, rotation=30)
        right.set_ylabel("requests/s")
        right.set_title(THROUGHPUT[1].replace("\n", ", "), fontsize=9)
    fig.suptitle(title or f"Prism {data.shape} on {data.device}".strip(), fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    data = chart_data(json.loads(args.json.read_text()))
    draw(data, args.out, args.title)
    for name in data.engines:
        ms = ", ".join("-" if m is None else f"{m:.1f} ms" for m in data.ms[name])
        sys.stdout.write(f"{_label(name)}: {ms}; {data.req_per_s[name] or '-'} req/s\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
