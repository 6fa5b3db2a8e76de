"""One-pass forest tests run the real Triton kernels: compiled on CUDA, interpreted on CPU.

As in tests/engine/kernels: triton picks its interpreter when first imported, so the variable
is set here, at collection, before anything imports triton.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from body_cases import CACHE_BYTES, DEVICE, REQUESTS, BodyDecisions

from engine.engine import Engine  # imports triton only at a kernel's first launch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")  # only now: importing triton fixes the interpreter choice


@pytest.fixture(scope="session")
def body_model(gguf_model: Callable[..., Path]) -> Path:
    """The tiny Q8_0 model with activation outliers every body test runs."""
    return gguf_model("Q8_0", "tiny", 0, False, 4)


@pytest.fixture(scope="session")
def body_engine(body_model: Path) -> Engine:
    """The engine whose forests run the body: CUDA's default engine, forced (`body=True`) on CPU."""
    body = None if DEVICE == "cuda" else True  # CUDA: the default must be the body
    return Engine.load(body_model, device=DEVICE, precision="int8", cache_bytes=CACHE_BYTES, body=body)


@pytest.fixture(scope="session")
def levels_engine(body_model: Path) -> Engine:
    """The level-by-level executor's engine over the same model: the body's oracle (test_body
    also shares its root and weights with a `ForestBody`)."""
    return Engine.load(body_model, device=DEVICE, precision="int8", cache_bytes=0, body=False)


@pytest.fixture(scope="session")
def body_decisions(body_engine: Engine) -> BodyDecisions:
    """Each decision once per session: on CPU every one is tens of seconds of interpreted kernels, and
    test_body_engine (alone / batch / cache, the level executor) and test_body_tp (two ranks)
    compare against the same ones."""
    engine = body_engine
    assert engine.body is not None
    engine.cache.clear()
    batch = engine.decide(REQUESTS)
    hits = engine.cache.stats.hits
    again = engine.decide(REQUESTS[::-1])[::-1]  # evidence now comes from the prefix cache
    hits = engine.cache.stats.hits - hits
    alone = []
    for r in REQUESTS:
        engine.cache.clear()  # every request computes its evidence
        alone.append(engine.decide([r])[0])
    engine.cache.clear()
    return BodyDecisions(batch, again, alone, hits)
