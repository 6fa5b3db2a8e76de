"""Session fixtures of the engine tests: canonical weights and loaded engines, made once per session.

`gguf_model(quant, dims, ...)`, the generated GGUF files they load, is tests/conftest.py's: the
serve, pipeline and reliability tests load the same files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.decide.decision_config import DecisionConfig
from engine.engine import Engine
from engine.model.weights import Weights
from engine.testing.make_model import canonical_random_weights, dims_config


@pytest.fixture(scope="session")
def canonical_weights() -> Callable[..., Weights]:
    """`canonical_weights(dims="tiny", seed=0, outliers=0) -> Weights` (what the generator wrote)."""
    cache: dict[tuple, Weights] = {}

    def get(dims: str = "tiny", seed: int = 0, outliers: int = 0) -> Weights:
        key = (dims, seed, outliers)
        if key not in cache:
            cache[key] = canonical_random_weights(dims_config(dims), seed, outliers)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def loaded_engine(gguf_model: Callable[..., Path]) -> Callable[..., Engine]:
    """`loaded_engine(quant="F32", dims="tiny", seed=0, cache_bytes=None) -> Engine` (fp32, CPU),
    loaded once per session per key. `cache_bytes=0` turns the cross-request prefix cache off,
    so every decide computes its evidence (what forest counter tests need).

    Callers may read `last_counters` but must not replace `decision_config` or weights: build a
    new `Engine(weights=..., ...)` for another config instead.
    """
    cache: dict[tuple, Engine] = {}

    def get(quant: str = "F32", dims: str = "tiny", seed: int = 0, cache_bytes: int | None = None) -> Engine:
        key = (quant, dims, seed, cache_bytes)
        if key not in cache:
            cache[key] = Engine.load(
                gguf_model(quant, dims, seed),
                precision="fp32",
                decision_config=DecisionConfig(),
                cache_bytes=cache_bytes,
            )
        return cache[key]

    return get
