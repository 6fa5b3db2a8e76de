"""Shared by the serve tests (imported by file name, like tests/schemas/schema_strategies.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.engine import Engine
from prism_pipeline.serve.app import AppConfig
from prism_pipeline.serve.metrics import ServeMetrics

API_KEY = "test-key-0123456789"


@dataclass
class Served:
    url: str
    config: AppConfig
    metrics: ServeMetrics
    engine: Engine
