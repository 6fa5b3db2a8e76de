"""Prometheus metrics of one worker.

Each worker owns its own registry (several workers may share a process in tests and in the
demo, and the default registry refuses duplicate names). `serve(port)` exposes it over HTTP.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.events_in = Counter("prism_events_in", "Evidence messages consumed", registry=r)
        self.records_out = Counter("prism_records_out", "Decision records acknowledged by Kafka", registry=r)
        self.dead_letters = Counter(
            "prism_dead_letters", "Messages sent to the dead-letter topic", ["reason"], registry=r
        )
        self.batch_events = Histogram(
            "prism_batch_events", "Events per engine batch", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "prism_batch_tokens", "Prompt tokens per engine batch", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.engine_seconds = Histogram(
            "prism_engine_seconds",
            "Wall time of one engine.decide call",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.end_to_end_seconds = Histogram(
            "prism_end_to_end_seconds",
            "Kafka timestamp of the evidence to acknowledgement of its decision record",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.consumer_lag = Gauge(
            "prism_consumer_lag", "High watermark minus position", ["topic", "partition"], registry=r
        )
        self.questions = Counter("prism_questions", "Questions decided", registry=r)
        self.questions_thought = Counter(
            "prism_questions_thought", "Questions that went through AutoThink", registry=r
        )
        self.autothink_rate = Gauge(
            "prism_autothink_rate", "Share of decided questions that thought (since start)", registry=r
        )
        self.cache_hit_rate = Gauge(
            "prism_cache_hit_rate",
            "Share of evidence lookups served by the engine's prefix cache",
            registry=r,
        )
        self.cache_hits = Gauge("prism_cache_hits", "Prefix-cache hits since the engine started", registry=r)
        self.cache_misses = Gauge(
            "prism_cache_misses", "Prefix-cache misses since the engine started", registry=r
        )
        self.cache_bytes = Gauge("prism_cache_bytes", "Bytes held by the prefix cache", registry=r)
        self.cache_evictions = Gauge(
            "prism_cache_evictions", "Prefix-cache evictions since the engine started", registry=r
        )
        self.paused = Gauge(
            "prism_partitions_paused", "1 while fetching is paused for backpressure", registry=r
        )
        self.pauses = Counter(
            "prism_backpressure_pauses", "Times fetching was paused for backpressure", registry=r
        )
        self.queued_batches = Gauge("prism_queued_batches", "Batches waiting for the engine", registry=r)
        self._questions_total = 0
        self._thought_total = 0
        self._server: Any = None

    def observe_questions(self, total: int, thought: int) -> None:
        self.questions.inc(total)
        self.questions_thought.inc(thought)
        self._questions_total += total
        self._thought_total += thought
        if self._questions_total:
            self.autothink_rate.set(self._thought_total / self._questions_total)

    def observe_cache(self, stats: Any) -> None:
        """Mirror the engine's `engine.cache.CacheStats` (hits, misses, bytes, evictions)."""
        self.cache_hits.set(stats.hits)
        self.cache_misses.set(stats.misses)
        self.cache_bytes.set(stats.bytes)
        self.cache_evictions.set(stats.evictions)
        self.cache_hit_rate.set(stats.hit_rate)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        started = start_http_server(port, addr=addr, registry=self.registry)
        # prometheus-client >= 0.17 returns (server, thread); keep the server to shut it down.
        self._server = started[0] if isinstance(started, tuple) else None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample (tests and the demo summary)."""
        got = self.registry.get_sample_value(name, labels or {})
        return 0.0 if got is None else got
