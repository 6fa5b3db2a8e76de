"""JevBench's structural relations against `prism serve` as a user runs it (a subprocess, the jevbench
CLI), with AutoThink on (gate 1: every question of up to 26 options thinks, 4-token budget) and off.

These relations hold whatever the weights are, because the engine sees exactly the same tokens:
- key_rename, key_instruction_conflict: a question's key is never rendered, and a thought's draws
  are keyed by what the model sees (seed, evidence digest, question tokens), not by the key;
- duplicate_question, batch_solo, batch_order, batch_content, batch_size_sweep: a question's bits
  do not depend on its companions, their order or the batch (int8), nor on a second copy of it;
- noul_as_choice with the choice's options in yes-first order: `{"yes": "Yes", "no": "No"}`
  renders as the noul's `A) yes` / `B) no`, token for token (no-first is another prompt, so its
  answer is a property of the weights: reported, not asserted);
- routing_stability's neutral key and solo ask (its reversed options are another prompt too).

int8 runs at zero tolerance (`--noise-floor 0`, every deviation exactly 0.0); fp32 (not batch
invariant: forests of different shapes round differently) at jevbench's default tolerance.
The default run is every case of serve_structural_cases on int8 with AutoThink on (among
them a 30-option choice in rounds, nouls and a score); the slow matrix adds AutoThink off and
the fp32 path, on and off.
`-s` prints each run's table (what ops/bench/RESULTS.md records).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from jevbench.engine import trial_rng
from jevbench.relations import REGISTRY, Context
from jevbench.schema import Case
from serve_structural_cases import CASES, write_cases

REPO = Path(__file__).resolve().parents[2]
PRISM = [sys.executable, "-m", "prism_pipeline.cli"]
JEVBENCH = [sys.executable, "-c", "from jevbench.cli import main; main()"]
MODEL_NAME = "prism-test-qwen35"
BUDGET = 4
RELATIONS = [
    "key_rename",
    "key_instruction_conflict",
    "duplicate_question",
    "noul_as_choice",
    "routing_stability",  # a diagnostic: runs only when named
    "batch_solo",
    "batch_order",
    "batch_content",
    "batch_size_sweep",
]
CONCURRENCY = 4  # requests in flight: the server batches them (several per engine forest)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`prism serve --precision P --gate G --thought-budget 4` on a free port, until stopped."""

    def __init__(self, model: Path, precision: str, think: bool) -> None:
        self.precision, self.think = precision, think
        port = _free_port()
        gate = "1" if think else "0"
        self.proc = subprocess.Popen(
            [
                *PRISM, "serve", "--model", str(model), "--port", str(port), "--precision", precision,
                "--gate", gate, "--thought-budget", str(BUDGET), "--max-wait-ms", "20",
            ],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(self.proc.stdout.read() if self.proc.stdout else "prism serve exited")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError("prism serve did not become healthy")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, out


@pytest.fixture(scope="module")
def servers(model_path: Path) -> Iterator[dict[tuple[str, bool], Server]]:
    """Started on first use, one per (precision, AutoThink), stopped at the end of the module."""
    started: dict[tuple[str, bool], Server] = {}

    class Lazy(dict):
        def __missing__(self, key: tuple[str, bool]) -> Server:
            started[key] = self[key] = Server(model_path, *key)
            return started[key]

    yield Lazy()
    for server in started.values():
        server.stop()


def run_jevbench(server: Server, tmp: Path, n_cases: int | None, *extra: str) -> dict:
    url = f"{server.url}/v1/systemone"
    # AutoThink is really on (or off): the first case's questions write thought tokens (or none)
    case = CASES[0]
    usage = httpx.post(url, json={"state": case["state"], "questions": case["questions"]}, timeout=120)
    thought_tokens = usage.json()["usage"]["output_tokens"]
    assert (thought_tokens > 0) if server.think else (thought_tokens == 0), usage.text
    out = tmp / "structural.json"
    cmd = [
        *JEVBENCH, "run", "--cases", str(write_cases(tmp / "cases.jsonl", n_cases)),
        "--backend", f"systemone:{MODEL_NAME}", "--url", ",".join([url] * CONCURRENCY),
        "--relations", ",".join(RELATIONS), "--concurrency", str(CONCURRENCY), "--no-cache",
        "--out", str(out), *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    think = "on" if server.think else "off"
    print(f"\n[{server.precision}, AutoThink {think}] {time.monotonic() - t0:.0f} s")
    print(proc.stdout)
    return json.loads(out.read_text())


def yes_first(case: dict, key: str, seed: int = 0) -> bool:
    """Whether jevbench's noul_as_choice trial for (case, key) lists `yes` first: the same draw
    jevbench makes (its trials depend only on the seed and the case, never on answers)."""
    c = Case(id=case["id"], state=case["state"], questions=case["questions"])
    ctx = Context(base={}, noise={})
    trial = REGISTRY["noul_as_choice"].build(c, key, trial_rng(seed, c.id, "noul_as_choice", key, "0"), ctx)
    return trial.params["order"][0] == "yes"


# |p/(p+q) - p| for p <= 1 and p + q within two ulps of 1 (the engine normalizes with one fsum),
# plus the division's own rounding: jevbench's reading of a choice, not the engine's numbers
NORMALIZE_ULP = 2.0**-51


def _is_nac(outcome: dict) -> bool:
    return outcome["relation"] == "noul_as_choice"


def exact_noul_as_choice(server: Server, n_cases: int | None) -> int:
    """noul_as_choice's yes-first trials on the wire: the choice's `yes` probability is the noul's
    P(yes) bit for bit, and every other answer of the request is unchanged. Returns the count."""
    url = f"{server.url}/v1/systemone"
    checked = 0
    for case in CASES[:n_cases]:
        base = httpx.post(url, json={"state": case["state"], "questions": case["questions"]}, timeout=120)
        for key, q in case["questions"].items():
            if q["type"] != "noul" or not yes_first(case, key):
                continue
            choice = {
                "type": "choice",
                "instructions": q["instructions"],
                "criteria": {"yes": "Yes", "no": "No"},
            }
            questions = {k: (choice if k == key else v) for k, v in case["questions"].items()}
            variant = httpx.post(url, json={"state": case["state"], "questions": questions}, timeout=120)
            a, b = base.json()["answers"], variant.json()["answers"]
            assert b[key]["probabilities"]["yes"].hex() == a[key]["noul"].hex(), (case["id"], key)
            assert {k: v for k, v in a.items() if k != key} == {k: v for k, v in b.items() if k != key}
            checked += 1
    return checked


def _summary(structural: list[dict], outcomes: list[dict]) -> None:
    """Per relation: structural outcomes, violated, largest deviation (exact); the rest counted apart."""
    kept = {id(o) for o in structural}
    for name in RELATIONS:
        mine = [o for o in outcomes if o["relation"] == name]
        if name == "routing_stability":
            flips = [o["detail"]["flips"] for o in mine]
            same = sum(bool(f.get("neutral_key") or f.get("solo")) for f in flips)
            other = sum(bool(f.get("reversed_options")) for f in flips)
            print(f"  {name:26} {len(mine):3} trials, {same} flipped by a neutral key or a solo ask; "
                  f"{other} by reversed options (another prompt)")  # fmt: skip
            continue
        held = [o for o in mine if id(o) in kept]
        worst = max((o["deviation"] for o in held), default=0.0)
        other = f"; {len(mine) - len(held)} not structural" if len(mine) > len(held) else ""
        print(
            f"  {name:26} {len(held):3} structural, {sum(o['violated'] for o in held)} violated, "
            f"max deviation {worst!r}{other}"
        )


def check(result: dict, n_cases: int | None, zero: bool) -> None:
    """Every structural outcome holds: exactly (deviation 0.0) when `zero`, else at the tolerance."""
    assert result["errors"] == [] and not result["backend_down"] and not result["truncated_by_budget"]
    cases = {c["id"]: c for c in CASES[:n_cases]}
    outcomes = result["outcomes"]
    assert {o["relation"] for o in outcomes} == set(RELATIONS)
    structural, yes_first_nouls = [], 0
    for o in outcomes:
        if o["relation"] == "noul_as_choice":
            (key,) = o["targets"]
            if not yes_first(cases[o["case_id"]], key):
                continue  # another prompt (no-first): not structural
            yes_first_nouls += 1
        if o["relation"] == "routing_stability":
            flips = o["detail"]["flips"]
            assert not flips.get("neutral_key") and not flips.get("solo"), o
            continue  # its reversed-options ask is another prompt
        structural.append(o)
    _summary(structural, outcomes)
    if zero:
        assert result["noise_floor"] == 0
        # jevbench divides a choice's probabilities by their sum (1 within an ulp, in floats), a
        # noul's P(yes) by nothing: that one division's rounding is all noul_as_choice may show
        # here; exact_noul_as_choice checks the wire values themselves, bit for bit
        assert [o for o in structural if o["deviation"] > (NORMALIZE_ULP if _is_nac(o) else 0.0)] == []
    else:
        assert [o for o in structural if o["violated"]] == []
    assert yes_first_nouls > 0, "no yes-first noul_as_choice trial (see serve_structural_cases)"
    # the 30-option choices (rounds) were among the questions the relations moved around
    many = {
        (c, k)
        for c, case in cases.items()
        for k, q in case["questions"].items()
        if len(q.get("criteria") or ()) > 26
    }
    assert many and many <= {
        (o["case_id"], o["targets"][0]) for o in outcomes if o["relation"] == "key_rename"
    }


# AutoThink on is the default run's (a case's thought keys, budget cut and second read-out all
# cross the wire); off is the slow matrix's. A one-case default run beside these would repeat
# the first case's trials on the same server: every assertion it made, the all-case run makes.
@pytest.mark.parametrize(
    "think", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["autothink-on", "autothink-off"]
)
def test_structural_relations_int8_exact(servers, tmp_path: Path, think: bool) -> None:
    server = servers["int8", think]
    check(run_jevbench(server, tmp_path, None, "--noise-floor", "0"), None, zero=True)
    assert exact_noul_as_choice(server, None) == 3


@pytest.mark.slow
@pytest.mark.parametrize("think", [True, False], ids=["autothink-on", "autothink-off"])
def test_structural_relations_fp32_at_jevbench_tolerance(servers, tmp_path: Path, think: bool) -> None:
    check(run_jevbench(servers["fp32", think], tmp_path, None), None, zero=False)
