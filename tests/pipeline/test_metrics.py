"""Worker metrics mirror the engine's prefix-cache statistics."""

from __future__ import annotations

import torch
from prometheus_client import generate_latest

from engine.cache import PrefixCache
from engine.run.forest import SegmentState
from prism_pipeline.worker.metrics import WorkerMetrics


def state(nbytes: int) -> SegmentState:
    st = SegmentState(parent=None, start=0, length=1)
    st.conv[0] = torch.zeros(nbytes // 4)
    return st


def test_cache_stats_are_exported() -> None:
    cache = PrefixCache(budget_bytes=1000)
    cache.put("a", state(400))
    cache.get("a")
    cache.get("b")
    cache.put("b", state(400))
    cache.put("c", state(400))  # evicts "a", the least recently used
    metrics = WorkerMetrics()
    metrics.observe_cache(cache.stats)
    text = generate_latest(metrics.registry).decode()
    assert "prism_cache_hits 1.0" in text
    assert "prism_cache_misses 1.0" in text
    assert "prism_cache_evictions 1.0" in text
    assert "prism_cache_bytes 800.0" in text
    assert "prism_cache_hit_rate 0.5" in text
