"""Fixture requests whose records must keep their exact bits across refactors of `engine/`.

Why: moving the engine's modules, or giving its loops one definition, must not move one bit of a
decision. These requests cover every stage a record can carry - a yes/no, a choice with more than
26 options (rounds), a score, an AutoThink thought with a fixed seed (forest steps and, forced,
the device decoder's steps), a second decide served from the warm prefix cache - on the generated
tiny Q8_0 model at int8 and fp32 (the level executor, the CPU paths). `capture` writes every
record's numbers as `float.hex`; `test_bits_unchanged.py` re-runs them and compares.

    PYTHONPATH=. python tests/engine/bits_cases.py [--out tests/engine/data/bits_before.json]

fp32 CPU kernels may round differently per instruction set, per torch build and per CPU, so the
JSON names `torch.__version__`, `torch.backends.cpu.get_cpu_capability()` and a digest of a few
fp32 ops' bits on fixed inputs (`kernel_rounding`); the test compares only under all three, and
skips elsewhere (an exact match on another CPU would be an accident, not a promise).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

# The body and the decoder run their Triton kernels on CPU in the interpreter, which triton picks
# when it is first imported (as tests/engine/body/conftest.py does): set before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.decide.decision_config import DecisionConfig
from engine.engine import Engine
from engine.testing.make_model import make_model
from engine.types import DecideRequest, DecideResult
from schemas.record import Readout
from schemas.systemone import SystemOneRequest

DATA = Path(__file__).parent / "data" / "bits_before.json"
# the generated model, as `gguf_model("Q8_0", "tiny", 0, False, 0)` in tests/conftest.py
MODEL = {"quant": "Q8_0", "dims": "tiny", "seed": 0, "mtp": False, "outliers": 0}
PRECISIONS = ("int8", "fp32")
CACHE_BYTES = 1 << 28
BODY_CASES = ("yes_no", "thought")  # the body runs in Triton's interpreter on CPU: slow, so two


def _request(event_id: str, state: str, questions: dict[str, Any], **kw: Any) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": questions})
    return DecideRequest(event_id, body, **kw)


def requests() -> dict[str, DecideRequest]:
    """The fixture requests by name (each decided alone, in this order, on a fresh engine)."""
    many = {f"team-{i:02d}": (f"owns service {i}" if i % 3 else None) for i in range(30)}
    return {
        "yes_no": _request("e-yes-no", "checkout-api 502 rate 12% for 4m", {"q": {"type": "noul"}}, gate=0.0),
        "choice_rounds": _request(
            "e-rounds",
            "pod OOMKilled x7 on node-3, replica lag 40s",
            {"q": {"type": "choice", "instructions": "Which team?", "criteria": many}},
            gate=0.0,
        ),
        "score": _request(
            "e-score",
            {"alert": "p99 latency 2.4s", "region": "eu-west-1"},  # type: ignore[arg-type]
            {"q": {"type": "score", "instructions": "Severity?", "criteria": ["low", "mid", "high", "page"]}},
            gate=0.0,
        ),
        "thought": _request(
            "e-thought",
            "disk 97% on db-primary-02 after deploy v2.31.0",
            {
                "q": {
                    "type": "choice",
                    "instructions": "Who acts?",
                    "criteria": {"dba": None, "sre": None, "net": None},
                },
                "r": {"type": "noul", "instructions": "Roll back?"},
            },
            seed=1234,
            gate=1.0,
            thought_budget=6,
        ),
    }


def _hex(xs: Any) -> list[str]:
    return [float(x).hex() for x in xs]


def _readout_bits(readout: Readout | None) -> list[str]:
    """A read-out's probabilities, coverage, temperature, then per round its options, letters,
    logits and coverage; "none" for a read-out that did not happen."""
    if readout is None:
        return ["none"]
    head = _hex([*readout.probabilities, readout.coverage, readout.temperature])
    rounds = [[*r.options, *r.letters, *_hex(r.logits), float(r.coverage).hex()] for r in readout.rounds]
    return head + [v for r in rounds for v in r]


def record_bits(result: DecideResult) -> dict[str, Any]:
    """Every number of every record of `result` as float.hex, with the thought text and answers."""
    out: dict[str, Any] = {"input_tokens": result.input_tokens, "output_tokens": result.output_tokens}
    for qid, t in sorted(result.traces.items()):
        values = _readout_bits(t.first) + _readout_bits(t.second) + _hex(t.final_probabilities)
        values += [repr(t.thought), str(t.thought_tokens), str(t.thought_truncated)]
        out[qid] = {
            "values": values,
            "answer": result.answers[qid].model_dump(mode="json"),
            "thought_ids": result.thought_ids.get(qid),
        }
    return out


def _engine(model: Path, precision: str, **kw: Any) -> Engine:
    return Engine.load(model, precision=precision, decision_config=DecisionConfig(), **kw)


def decide_all(model: Path) -> dict[str, Any]:
    """The records of every fixture request per precision (the comparable part of the JSON)."""
    out: dict[str, Any] = {}
    for precision in PRECISIONS:
        engine = _engine(model, precision, cache_bytes=0)
        got = {name: record_bits(engine.decide([req])[0]) for name, req in requests().items()}
        # the prefix cache warm: the second decide of the same request starts from the kept evidence
        warm = _engine(model, precision, cache_bytes=CACHE_BYTES)
        req = requests()["thought"]
        got["cache_cold"] = record_bits(warm.decide([req])[0])
        got["cache_warm"] = record_bits(warm.decide([req])[0])
        if warm.cache.stats.hits < 1:
            raise AssertionError("the warm decide did not hit the prefix cache")
        out[precision] = got
    if not interpreted():
        return out
    # int8 through the CUDA paths' code on CPU: the one-pass body (Triton's interpreter) and the
    # device decoder's thought steps
    body = _engine(model, "int8", cache_bytes=0, body=True)
    out["int8_body"] = {name: record_bits(body.decide([requests()[name]])[0]) for name in BODY_CASES}
    decoder = _engine(model, "int8", cache_bytes=0, decoder=True)
    out["int8_decoder"] = {"thought": record_bits(decoder.decide([requests()["thought"]])[0])}
    return out


def interpreted() -> bool:
    """Whether Triton kernels run on CPU here (the interpreter): the body's and decoder's records."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def platform() -> dict[str, str]:
    """What the CPU paths' fp32 bits depend on besides the code: the torch build, the instruction
    set torch dispatches to, and `kernel_rounding`."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_rounding": kernel_rounding(),
    }


def kernel_rounding() -> str:
    """A digest of the bits a few fp32 CPU ops the paths use give on fixed inputs (one thread).

    Why: two CPUs of one instruction-set level (e.g. AVX512 with and without AMX) can run other
    BLAS kernels that round differently (seen 2026-12-02: the same torch build and capability,
    other fp32 records). Where this digest differs from the capture's, an unequal record says
    nothing about the code, so the test skips; where it is equal, the records must be too.
    """
    g = torch.Generator().manual_seed(7)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = []
        for m, k, n in ((1, 64, 96), (7, 64, 96), (33, 128, 256), (5, 256, 64)):
            x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
            y = torch.nn.functional.linear(x, w)
            outs += [y, torch.softmax(y, dim=-1), y @ w, torch.rsqrt(y.abs() + 1.0), torch.exp(-y.abs())]
            outs.append(torch.nn.functional.layer_norm(y, (n,)))
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256()
    for t in outs:
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def generate_model(folder: Path) -> Path:
    m = MODEL
    return make_model(folder / "bits.gguf", m["quant"], m["dims"], m["seed"], m["mtp"], m["outliers"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the test suite runs (tests/conftest.py)
    with tempfile.TemporaryDirectory() as tmp:
        records = decide_all(generate_model(Path(tmp)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**platform(), "model": MODEL, "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
