"""`Engine.decide` with forests in one pass: the contract's bit invariances hold through it, and its
decisions agree with the level-by-level executor's. On CUDA the engine is the default one (the
body is the CUDA int8 path) with compiled kernels and CUDA graphs; on CPU the body is forced
(`body=True`) and its kernels run in Triton's interpreter. Every tensor lives on DEVICE: a CPU
tensor handed to a compiled kernel is what broke these tests on a GPU machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import engine as engine_module
from engine.cache import PrefixCache
from engine.engine import Engine, uses_body
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the conftest compiles on CUDA, else interprets

CHOICE = {
    "type": "choice",
    "instructions": "Which team owns it?",
    "criteria": {"dba": None, "sre": None, "net": None},
}
YES_NO = {"type": "noul", "instructions": "Is it customer-facing?"}


def _req(event_id: str, state: str, *, gate: float = 0.0, budget: int = 0, seed: int = 3) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": {"team": CHOICE, "cx": YES_NO}})
    return DecideRequest(event_id, body, seed=seed, gate=gate, thought_budget=budget)


REQUESTS = [
    _req("a", "api latency 900ms on checkout, db-3 cpu 95%"),
    _req("b", "disk 97% on db-3 <|im_end|> <think>", gate=1.0, budget=2, seed=9),  # specials as text
    _req("c", "bgp session flapping on edge-2"),
]


CACHE_BYTES = 1 << 28
pytestmark = pytest.mark.slow  # the Triton interpreter runs every kernel of every pass


@pytest.fixture(scope="module")
def model(gguf_model: Callable[..., Path]) -> Path:
    return gguf_model("Q8_0", "tiny", 0, False, 4)


@pytest.fixture(scope="module")
def engine(model: Path) -> Engine:
    body = None if DEVICE == "cuda" else True  # CUDA: the default must be the body
    return Engine.load(model, device=DEVICE, precision="int8", cache_bytes=CACHE_BYTES, body=body)


def test_the_body_is_the_cuda_int8_default_and_the_oracle_elsewhere() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert uses_body(None, "int8", cuda)
    assert not uses_body(None, "int8", cpu) and not uses_body(None, "fp32", cpu)
    assert not uses_body(None, "bf16", cuda) and not uses_body(None, "fp32", cuda)
    assert not uses_body(False, "int8", cuda) and uses_body(True, "int8", cpu)
    with pytest.raises(ValueError, match="int8 path only"):
        uses_body(True, "bf16", cuda)


def test_decisions_have_the_same_bits_alone_in_a_batch_and_from_the_cache(engine: Engine) -> None:
    assert engine.body is not None
    alone = []
    for r in REQUESTS:
        engine.cache = PrefixCache(CACHE_BYTES)  # every request computes its evidence
        alone.append(engine.decide([r])[0])
    engine.cache = PrefixCache(CACHE_BYTES)
    batch = engine.decide(REQUESTS)
    again = engine.decide(REQUESTS[::-1])[::-1]  # evidence now comes from the prefix cache
    assert engine.cache.stats.hits > 0
    for b, a, s in zip(batch, again, alone, strict=True):
        assert b.traces == a.traces == s.traces
    assert batch[1].traces["team"].thought_tokens > 0  # the gate sent it through a thought


def test_decisions_agree_with_the_level_executor(
    engine: Engine, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exact body (no tensor-core settings): the same answers and probabilities equal to the
    int8 rounding the two paths' float ops allow. The CUDA default's tensor-core settings round
    in bf16 (their accuracy against fp32 is measured by ops/bench/bench_engine.py --accuracy,
    RESULTS.md): the same answers."""
    levels = Engine.load(model, device=DEVICE, precision="int8", cache_bytes=0, body=False)
    want = levels.decide(REQUESTS[::2])
    exact = engine
    if DEVICE == "cuda":  # the fixture's engine runs the CUDA default settings
        monkeypatch.setattr(engine_module, "CUDA_BODY_SETTINGS", {})
        exact = Engine.load(model, device=DEVICE, precision="int8", cache_bytes=0, body=True)
    for got, bound in ((exact.decide(REQUESTS[::2]), 1e-3), (engine.decide(REQUESTS[::2]), None)):
        for g, w in zip(got, want, strict=True):
            for qid in ("team", "cx"):
                gf, wf = g.traces[qid].first, w.traces[qid].first
                assert gf.probabilities.index(max(gf.probabilities)) == wf.probabilities.index(
                    max(wf.probabilities)
                )
                if bound is not None:
                    for p, q in zip(gf.probabilities, wf.probabilities, strict=True):
                        assert abs(p - q) <= bound
