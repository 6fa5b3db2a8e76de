"""Session fixtures: generated qwen35 GGUF files, made once per test session.

Every generated model carries the full 248,320-row vocabulary, so generation costs seconds;
`gguf_model(quant, dims, ...)` caches each distinct file for the whole session.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.testing.make_model import canonical_random_weights, dims_config, make_model
from engine.weights import Weights


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`gguf_model(quant="F32", dims="tiny", seed=0, mtp=False, outliers=0) -> Path`."""
    root = tmp_path_factory.mktemp("gguf_models")
    cache: dict[tuple, Path] = {}

    def get(
        quant: str = "F32", dims: str = "tiny", seed: int = 0, mtp: bool = False, outliers: int = 0
    ) -> Path:
        key = (quant, dims, seed, mtp, outliers)
        if key not in cache:
            name = f"{dims}-{quant}-s{seed}{'-mtp' if mtp else ''}-o{outliers}.gguf"
            cache[key] = make_model(root / name, quant, dims, seed, mtp, outliers)
        return cache[key]

    return get


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
