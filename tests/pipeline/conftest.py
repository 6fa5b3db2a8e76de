"""Fixtures of the pipeline tests: a generated tiny model and one engine per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.decide.decision_config import DecisionConfig

# Thinking is off unless an event asks for it (gate 1.0), and then short: the tiny model's
# reference forward decodes slowly on CPU and the tests are about the pipeline.
TEST_GATE = 0.0
TEST_THOUGHT_BUDGET = 3


@pytest.fixture(scope="session")
def tiny_model(gguf_model: Callable[..., Path]) -> Path:
    """The session's tiny Q8_0 model (tests/conftest.py's, which the engine tests load too)."""
    return gguf_model("Q8_0", "tiny")


def _engine(tiny_model: Path, precision: str):  # -> engine.Engine
    from engine.engine import Engine

    return Engine.load(
        tiny_model,
        device="cpu",
        precision=precision,
        decision_config=DecisionConfig(gate=TEST_GATE, thought_budget=TEST_THOUGHT_BUDGET),
    )


@pytest.fixture(scope="session")
def tiny_engine(tiny_model: Path):  # -> engine.Engine
    return _engine(tiny_model, "fp32")


@pytest.fixture(scope="session")
def int8_engine(tiny_model: Path):  # -> engine.Engine
    """The same model on the int8 path: batch invariant, so any grouping reproduces a record."""
    return _engine(tiny_model, "int8")


@pytest.fixture
def worker_args(tiny_model: Path) -> list[str]:
    """CLI flags that make a `prism run` subprocess match `tiny_engine`."""
    return [
        "--model",
        str(tiny_model),
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--gate",
        str(TEST_GATE),
        "--thought-budget",
        str(TEST_THOUGHT_BUDGET),
    ]
