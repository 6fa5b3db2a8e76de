"""Fixtures of the reliability tests: the pipeline tests' generated tiny model, reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.load.scenarios import ScenarioConfig
from tests.pipeline.conftest import tiny_model  # noqa: F401  (the same generated model fixture)


@pytest.fixture
def scenario_config(tiny_model: Path, tmp_path: Path) -> ScenarioConfig:  # noqa: F811
    """Bounded load for CI: int8 (batch invariant, so re-decided events are byte-identical)."""
    return ScenarioConfig(model=tiny_model, workdir=tmp_path, events=60, producers=2, timeout_s=120)
