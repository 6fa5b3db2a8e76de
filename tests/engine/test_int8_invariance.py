"""The int8 path's determinism contract (DESIGN §2): a question's bits never depend on the batch.

Every probability, letter logit and coverage of every answer is compared exactly (as
`float.hex`) between the request decided alone and decided among 31 other requests (64
answers) in several orders and splits into `decide` calls, with and without AutoThink thoughts,
after a process restart, and with the evidence from the prefix cache. Parametrized by device:
the same file runs the CUDA checks on a GPU host (`torch._int_mm`), skipped elsewhere.

Only the int8 guarantee is tested here. The bf16/fp32 reference paths promise nothing about
batch invariance either way (README: the test suite, and "Commands"): whether their bits move
with the batch is an accident of the CPU's instruction set and the BLAS kernel torch picks, so
no test asserts it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import Engine
from engine.types import DecideRequest, DecideResult
from schemas.systemone import SystemOneRequest

DEVICES = [
    "cpu",
    # the CUDA default: the one-pass forest body (engine.run.body) with its CUDA graphs
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
N_REQUESTS = 32
WORDS = [
    "disk",
    "cpu",
    "memory",
    "host",
    "alert",
    "latency",
    "error",
    "timeout",
    "pod",
    "node",
    "restart",
    "kafka",
    "lag",
    "ticket",
    "user",
    "login",
    "db-primary-02",
    "94%",
    "12m",
    "eu-west-1",
    "OOMKilled",
    "502",
    "checkout-api",
    "replica",
    "p99",
    "rollback",
    "deploy",
    "v2.31.0",
]


def _request_payload(rng: random.Random, i: int) -> dict[str, Any]:
    n_words = rng.choice([1, 2, 3, 7, 15, 33, 45])  # odd token counts, some long evidence
    state: Any = {"alert": " ".join(rng.choice(WORDS) for _ in range(n_words)), "seq": i}
    if i % 5 == 0:
        state = " ".join(rng.choice(WORDS) for _ in range(n_words))
    kinds = [
        {"type": "noul", "instructions": rng.choice(["Act now?", "Is this noise?", None])},
        {
            "type": "choice",
            "instructions": "Which team?",
            "criteria": {
                f"opt{j}": rng.choice([None, "handles it", "owns the service"])
                for j in range(rng.randint(2, 7))
            },
        },
        {
            "type": "score",
            "instructions": "Severity?",
            "criteria": [f"level {j}" for j in range(rng.randint(2, 6))],
        },
    ]
    return {"state": state, "questions": {"a": rng.choice(kinds), "b": rng.choice(kinds)}}


def _requests(seed: int = 0) -> list[DecideRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(N_REQUESTS):
        thinks = i % 4 == 0  # gate 1.0: always think (short thoughts), else never
        out.append(
            DecideRequest(
                request_id=f"event-{i}",
                request=SystemOneRequest.model_validate(_request_payload(rng, i)),
                seed=1000 + i,
                gate=1.0 if thinks else 0.0,
                thought_budget=3,
            )
        )
    return out


def _bits(result: DecideResult) -> dict[str, list[str]]:
    """Exact bit patterns (float.hex) of everything numeric a question's record carries."""
    out: dict[str, list[str]] = {}
    for qid, trace in result.traces.items():
        vals: list[str] = []
        for readout in (trace.first, trace.second):
            if readout is None:
                vals.append("none")
                continue
            vals += [float(p).hex() for p in readout.probabilities]
            vals.append(float(readout.coverage).hex())
            for rnd in readout.rounds:
                vals += [float(x).hex() for x in rnd.logits]
        vals += [float(p).hex() for p in trace.final_probabilities]
        vals.append(repr(trace.thought))
        out[qid] = vals
    return out


@pytest.fixture(scope="module", params=DEVICES)
def int8_engine(request: pytest.FixtureRequest, gguf_model: Callable[..., Path]) -> Engine:
    # cache_bytes=0: every decide recomputes its evidence, so batches really share levels
    device, _, body = request.param.partition("-")
    return Engine.load(
        gguf_model("Q8_0", "tiny", 0, False, 4),
        device=device,
        precision="int8",
        cache_bytes=0,
        body=bool(body) or None,
    )


@pytest.fixture(scope="module")
def alone_bits(int8_engine: Engine) -> dict[str, dict[str, list[str]]]:
    return {r.request_id: _bits(int8_engine.decide([r])[0]) for r in _requests()}


def test_precision_defaults_and_names(int8_engine: Engine) -> None:
    from engine.run.path import default_precision

    assert int8_engine.precision == "int8"
    assert default_precision("cpu") == "fp32" and default_precision("cuda") == "int8"
    report = int8_engine.quant_report
    assert report is not None and report.alpha == 0.5 and report.calibration_prompts >= 16
    assert report.int8_bytes < report.float_bytes_replaced / 3


@pytest.mark.slow
def test_bits_do_not_depend_on_batch_order_or_grouping(
    int8_engine: Engine, alone_bits: dict[str, dict[str, list[str]]]
) -> None:
    requests = _requests()
    rng = random.Random(42)
    groupings = 0
    for trial in range(5):
        order = requests[:]
        rng.shuffle(order)
        if trial == 0:
            calls = [order]  # all 64 answers in one decide call
        else:  # random splits into several decide calls, including singletons
            cuts = sorted(rng.sample(range(1, N_REQUESTS), k=rng.randint(1, 6)))
            calls = [order[a:b] for a, b in zip([0, *cuts], [*cuts, N_REQUESTS], strict=True)]
        for call in calls:
            for req, result in zip(call, int8_engine.decide(call), strict=True):
                assert _bits(result) == alone_bits[req.request_id], (trial, req.request_id)
        groupings += 1
    assert groupings >= 5


@pytest.mark.slow
def test_question_alone_equals_question_in_a_batch(
    int8_engine: Engine, alone_bits: dict[str, dict[str, list[str]]]
) -> None:
    """A single question in its own request equals the same question inside a 2-question request."""
    for req in _requests()[:6]:
        for qid, question in req.request.questions.items():
            single = SystemOneRequest.model_validate(
                {"state": req.request.state, "questions": {qid: question.model_dump()}}
            )
            one = DecideRequest(req.request_id, single, req.seed, req.gate, req.thought_budget)
            assert _bits(int8_engine.decide([one])[0])[qid] == alone_bits[req.request_id][qid]


_CHILD = r"""
import json, sys
import torch
from engine.engine import Engine
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest
args = json.loads(sys.stdin.read())
torch.set_num_threads(args["threads"])
engine = Engine.load(args["path"], device=args["device"], precision="int8", body=args["body"])  # cache on
out = []
for attempt in range(2):  # miss, then hit
    reqs = [DecideRequest(r["id"], SystemOneRequest.model_validate(r["request"]), r["seed"], r["gate"], 3)
            for r in args["requests"]]
    out.append([{"id": r.request_id, "traces": {q: t.model_dump(mode="json") for q, t in res.traces.items()}}
                for r, res in zip(reqs, engine.decide(reqs))])
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_bits_survive_a_process_restart_and_the_prefix_cache(
    int8_engine: Engine, alone_bits: dict[str, dict[str, list[str]]], gguf_model: Callable[..., Path]
) -> None:
    requests = _requests()[:8]
    payload = {
        "path": str(gguf_model("Q8_0", "tiny", 0, False, 4)),
        "device": str(int8_engine.device.type),
        "body": int8_engine.body is not None,
        # a different intra-op thread count on purpose: no reduction may depend on it
        "threads": 2 if torch.get_num_threads() == 1 else 1,
        "requests": [
            {"id": r.request_id, "request": r.request.model_dump(mode="json"), "seed": r.seed, "gate": r.gate}
            for r in requests
        ],
    }
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    from schemas.record import QuestionTrace

    for attempt in json.loads(line[len("RESULT") :]):
        for item in attempt:
            traces = {q: QuestionTrace.model_validate(t) for q, t in item["traces"].items()}
            fake = DecideResult(
                request_id=item["id"], answers={}, traces=traces, input_tokens=0, output_tokens=0
            )
            assert _bits(fake) == alone_bits[item["id"]], item["id"]
