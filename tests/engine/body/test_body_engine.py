"""`Engine.decide` with forests in one pass: the contract's bit invariances hold through it, and its
decisions agree with the level-by-level executor's. On CUDA the engine is the default one (the
body is the CUDA int8 path) with compiled kernels and CUDA graphs; on CPU the body is forced
(`body=True`) and its kernels run in Triton's interpreter. Every tensor lives on DEVICE: a CPU
tensor handed to a compiled kernel is what broke these tests on a GPU machine.

The decisions themselves are made once per session (conftest's `body_decisions`): test_body_tp
compares two ranks against the same ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from body_cases import DEVICE, REQUESTS, THINKER, BodyDecisions

from engine.engine import Engine
from engine.run.path import choose_path

pytestmark = pytest.mark.slow  # the Triton interpreter runs every kernel of every pass


def test_the_body_is_the_cuda_int8_default_and_the_oracle_elsewhere() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_path(cuda, "int8", body=None).body
    assert not choose_path(cpu, "int8", body=None).body and not choose_path(cpu, "fp32", body=None).body
    assert not choose_path(cuda, "bf16", body=None).body and not choose_path(cuda, "fp32", body=None).body
    assert not choose_path(cuda, "int8", body=False).body and choose_path(cpu, "int8", body=True).body
    with pytest.raises(ValueError, match="int8 path only"):
        choose_path(cuda, "bf16", body=True)


def test_decisions_have_the_same_bits_alone_in_a_batch_and_from_the_cache(
    body_engine: Engine, body_decisions: BodyDecisions
) -> None:
    assert body_engine.body is not None
    d = body_decisions
    assert d.cache_hits > 0
    for b, a, s in zip(d.batch, d.again, d.alone, strict=True):
        assert b.traces == a.traces == s.traces
    assert d.batch[THINKER].traces["team"].thought_tokens > 0  # the gate sent it through a thought


def test_decisions_agree_with_the_level_executor(
    body_decisions: BodyDecisions, levels_engine: Engine, body_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exact body (no tensor-core settings): the same answers, and probabilities equal to the
    int8 rounding the two paths' float ops allow. The CUDA default's tensor-core settings round in
    bf16 (their accuracy against fp32 is measured by ops/bench/bench_engine.py --accuracy,
    RESULTS.md): the same answers. The default's side is the session's batch (bit-equal to each
    request alone and from the cache, above); on CPU that batch is the exact body's."""
    want = levels_engine.decide(REQUESTS[::2])
    default = body_decisions.batch[::2]
    exact = default
    if DEVICE == "cuda":
        engine = Engine.load(
            body_model, device=DEVICE, precision="int8", cache_bytes=0, body=True, body_settings={}
        )
        exact = engine.decide(REQUESTS[::2])
    for got, bound in ((exact, 1e-3), (default, None)):
        for g, w in zip(got, want, strict=True):
            for qid in ("team", "cx"):
                gf, wf = g.traces[qid].first, w.traces[qid].first
                assert gf.probabilities.index(max(gf.probabilities)) == wf.probabilities.index(
                    max(wf.probabilities)
                )
                if bound is not None:
                    for p, q in zip(gf.probabilities, wf.probabilities, strict=True):
                        assert abs(p - q) <= bound
