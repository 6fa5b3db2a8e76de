"""Forest vs per-question execution on CPU (fp32 path), on small generated Q8_0 models.

Each request carries ~256 tokens of evidence (unique per request, so nothing is shared across
requests) and three questions (noul, 4-option choice, 5-level score). Requests run serially,
one `decide` each, with AutoThink off (gate 0) and the cross-request cache off, so the two
modes differ only in how a batch executes:

- forest: the system segment was computed at load; the evidence runs once; each question
  runs only its own tokens from the evidence state.
- per_question: every question runs its whole prompt (system + evidence + question) alone.

Reports tokens processed per request (from the engine's forest counters), wall time per
request and the largest probability difference between the modes. Prints a table and appends
an entry to ops/bench/RESULTS.md (command, date, machine, commit, table).

    python ops/bench/bench_forest_cpu.py [--dims tiny small] [--requests 20] [--warmup 2]
        [--model path.gguf] [--no-record]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.decide.decision_config import DecisionConfig
from engine.engine import Engine
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
EVIDENCE_TOKENS = 256
MODES = ("forest", "per_question")
WORDS = (
    "alert",
    "disk",
    "latency",
    "customer",
    "refund",
    "invoice",
    "server",
    "region",
    "timeout",
    "retry",
    "queue",
    "backlog",
    "deploy",
    "rollback",
    "cpu",
    "memory",
    "error",
    "warning",
    "user",
    "login",
    "password",
    "reset",
    "ticket",
    "escalated",
    "payment",
    "failed",
    "card",
    "declined",
    "shipment",
    "delayed",
    "warehouse",
    "api",
    "gateway",
    "502",
    "503",
    "p99",
)
QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Does this need action today?"},
    "team": {
        "type": "choice",
        "instructions": "Which team owns it?",
        "criteria": {
            "billing": None,
            "sre": "Site reliability",
            "support": None,
            "security": "Security team",
        },
    },
    "severity": {
        "type": "score",
        "instructions": "How severe is it?",
        "criteria": ["none", "minor", "moderate", "major", "critical"],
    },
}


def evidence(i: int, count, rng: random.Random) -> str:
    """~EVIDENCE_TOKENS tokens of log-like text, unique to request `i`."""
    lines = [f"request {i} (run {rng.getrandbits(32):08x})"]
    while count("\n".join(lines)) < EVIDENCE_TOKENS:
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))))
    return "\n".join(lines)


def make_requests(engine: Engine, n: int, seed: int) -> list[DecideRequest]:
    rng = random.Random(seed)
    count = lambda s: len(engine.tokenizer.encode(s))  # noqa: E731
    return [
        DecideRequest(
            f"bench-{seed}-{i}",
            SystemOneRequest.model_validate({"state": evidence(i, count, rng), "questions": QUESTIONS}),
            seed=i,
            gate=0.0,
        )
        for i in range(n)
    ]


@dataclass
class ModeResult:
    mode: str
    tokens: list[int]
    seconds: list[float]
    probabilities: list[dict[str, list[float]]]

    @property
    def ms_median(self) -> float:
        return 1e3 * statistics.median(self.seconds)

    @property
    def ms_p90(self) -> float:
        s = sorted(self.seconds)
        return 1e3 * s[min(len(s) - 1, int(0.9 * len(s)))]


def run_modes(
    engine: Engine, warmup: list[DecideRequest], timed: list[DecideRequest]
) -> dict[str, ModeResult]:
    """Warm up both modes, then time each request in both modes back to back, alternating which
    goes first, so drifting load on a shared machine hits both modes alike."""
    for req in warmup:
        for mode in MODES:
            engine.decide([req], mode=mode)
    out = {mode: ModeResult(mode, [], [], []) for mode in MODES}
    for i, req in enumerate(timed):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            t0 = time.perf_counter()
            (result,) = engine.decide([req], mode=mode)
            r = out[mode]
            r.seconds.append(time.perf_counter() - t0)
            r.tokens.append(sum(c.tokens for c in engine.last_counters))
            r.probabilities.append({q: list(t.final_probabilities) for q, t in result.traces.items()})
    return out


def bench(model: Path, label: str, n: int, n_warmup: int, seed: int) -> tuple[list[str], float]:
    engine = Engine.load(model, precision="fp32", decision_config=DecisionConfig(), cache_bytes=0)
    # Both modes see the same timed requests, each new to the engine: warm-up requests differ.
    warmup = make_requests(engine, n_warmup, seed + 1)
    timed = make_requests(engine, n, seed)
    results = run_modes(engine, warmup, timed)
    f, p = results["forest"], results["per_question"]
    max_dp = max(
        abs(a - b)
        for fr, pr in zip(f.probabilities, p.probabilities, strict=True)
        for q in fr
        for a, b in zip(fr[q], pr[q], strict=True)
    )
    evidence_tokens = statistics.mean(len(engine.prompts.evidence_ids(r.request.state)) for r in timed)
    c = engine.config
    prefix_tokens = len(engine.prompts.prefix_ids)
    rows = []
    for r in (f, p):
        tokens = statistics.mean(r.tokens)
        rows.append(
            f"| {label} (h{c.hidden_size}, {c.num_layers}L) | {r.mode} | {tokens:.0f} "
            f"| {r.ms_median:.1f} | {r.ms_p90:.1f} | {1e3 / r.ms_median:.2f} "
            f"| {p.ms_median / r.ms_median:.2f}x | {statistics.mean(p.tokens) / tokens:.2f}x |"
        )
    rows.append(
        f"| {label} | evidence {evidence_tokens:.0f} tok/request, prefix {prefix_tokens} tok "
        f"| max abs prob diff {max_dp:.2e} | | | | | |"
    )
    return rows, max_dp


HEADER = (
    "| model | mode | tokens/request | median ms/request | p90 ms | requests/s | speed vs per_question "
    "| token reduction |\n|---|---|---|---|---|---|---|---|"
)


def sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"unknown ({e})"


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"{sh('nproc')} CPUs (nproc), {model}, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, Python {platform.python_version()}; load average at the end {load} (shared machine "
        f"when above the CPU count)"
    )


def commit() -> str:
    head = sh("git", "rev-parse", "HEAD")
    dirty = sh("git", "status", "--porcelain", "--untracked-files=no")
    return head + (" (working tree has uncommitted changes)" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", nargs="+", choices=("tiny", "small"), default=["tiny", "small"])
    ap.add_argument("--model", type=Path, help="benchmark this GGUF instead of generated models")
    ap.add_argument("--requests", type=int, default=10, help="timed requests per mode")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    a = ap.parse_args(argv)
    if a.requests < 1 or a.warmup < 0:
        ap.error("--requests must be >= 1 and --warmup >= 0")
    if a.threads is not None:
        if a.threads < 1:
            ap.error("--threads must be >= 1")
        torch.set_num_threads(a.threads)

    rows: list[str] = []
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="bench_forest_") as tmp:
        if a.model is not None:
            if not a.model.is_file():
                ap.error(f"--model {a.model}: no such file")
            models = [(a.model.name, a.model)]
        else:
            from engine.testing.make_model import make_model

            models = [
                (f"{d} Q8_0", make_model(Path(tmp) / f"{d}-q8_0.gguf", "Q8_0", d, a.seed)) for d in a.dims
            ]
        for label, path in models:
            r, max_dp = bench(path, label, a.requests, a.warmup, a.seed)
            rows += r
            worst = max(worst, max_dp)

    table = HEADER + "\n" + "\n".join(rows)
    print(table)
    if not a.no_record:
        args = sys.argv[1:] if argv is None else argv
        command = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, REPO), *args])
        entry = (
            f"\n## bench_forest_cpu: forest vs per-question, CPU fp32\n\n"
            f"- command: `{command}`\n- date: {sh('date', '-u')}\n- machine: {machine()}\n"
            f"- commit: {commit()}\n"
            f"- setup: {a.requests} timed serial requests, each run in both modes back to back "
            f"(alternating order), after {a.warmup} warm-up, "
            f"~{EVIDENCE_TOKENS} evidence tokens unique per request, 3 questions, gate 0, cache off\n\n"
            f"{table}\n"
        )
        with RESULTS.open("a", encoding="utf-8") as f:
            f.write(entry)
        print(f"\nappended to {os.path.relpath(RESULTS, REPO)}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
