"""Prometheus metrics of one worker.

Each worker owns its own registry (several workers may share a process in tests and in the
demo, and the default registry refuses duplicate names). `serve(port)` exposes it over HTTP.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import start_http_server

from prism_pipeline.metric_set import LATENCY_BUCKETS, SIZE_BUCKETS, MetricSet


class WorkerMetrics(MetricSet):
    def __init__(self) -> None:
        super().__init__()
        self.events_in = self.counter("prism_events_in", "Evidence messages consumed")
        self.records_out = self.counter("prism_records_out", "Decision records acknowledged by Kafka")
        self.dead_letters = self.counter(
            "prism_dead_letters", "Messages sent to the dead-letter topic", ["reason"]
        )
        self.batch_events = self.histogram("prism_batch_events", "Events per engine batch", SIZE_BUCKETS)
        self.batch_tokens = self.batch_tokens_histogram("prism_batch_tokens")
        self.engine_seconds = self.engine_seconds_histogram("prism_engine_seconds", LATENCY_BUCKETS)
        self.end_to_end_seconds = self.histogram(
            "prism_end_to_end_seconds",
            "Kafka timestamp of the evidence to acknowledgement of its decision record",
            LATENCY_BUCKETS,
        )
        self.consumer_lag = self.gauge(
            "prism_consumer_lag", "High watermark minus position", ["topic", "partition"]
        )
        self.questions = self.counter("prism_questions", "Questions decided")
        self.questions_thought = self.counter(
            "prism_questions_thought", "Questions that went through AutoThink"
        )
        self.autothink_rate = self.gauge(
            "prism_autothink_rate", "Share of decided questions that thought (since start)"
        )
        self.cache_hit_rate = self.gauge(
            "prism_cache_hit_rate", "Share of evidence lookups served by the engine's prefix cache"
        )
        self.cache_hits = self.gauge("prism_cache_hits", "Prefix-cache hits since the engine started")
        self.cache_misses = self.gauge("prism_cache_misses", "Prefix-cache misses since the engine started")
        self.cache_bytes = self.gauge("prism_cache_bytes", "Bytes held by the prefix cache")
        self.cache_evictions = self.gauge(
            "prism_cache_evictions", "Prefix-cache evictions since the engine started"
        )
        self.paused = self.gauge("prism_partitions_paused", "1 while fetching is paused for backpressure")
        self.pauses = self.counter("prism_backpressure_pauses", "Times fetching was paused for backpressure")
        self.queued_batches = self.gauge("prism_queued_batches", "Batches waiting for the engine")
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
