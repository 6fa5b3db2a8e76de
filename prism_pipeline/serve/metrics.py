"""Prometheus metrics of the HTTP server (`GET /metrics`).

One registry per app, like `WorkerMetrics`: tests start several servers in one process and the
default registry refuses duplicate names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from prism_pipeline.serve.dispatcher import BatchStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "prism_http_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "prism_http_request_seconds",
            "Wall time from request start to response, per route",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "prism_http_queue_seconds",
            "Time a /v1/systemone request waited for its engine batch to start",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            "prism_http_batch_requests", "Requests per engine batch", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "prism_http_batch_tokens", "Prompt tokens per engine batch", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.engine_seconds = Histogram(
            "prism_http_engine_seconds",
            "Wall time of one engine.decide call",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.questions = Counter("prism_http_questions", "Questions answered", ["type"], registry=r)
        self.thought_tokens = Counter(
            "prism_http_thought_tokens", "Thought tokens generated (answered or cut)", registry=r
        )
        self.thoughts_stopped = Counter(
            "prism_http_requests_stopped",
            "Requests whose thoughts the engine stopped: past their deadline, or cancelled "
            "(client gone, drain)",
            ["reason"],
            registry=r,
        )
        self.in_flight = Gauge("prism_http_in_flight", "/v1/systemone requests being handled", registry=r)
        self.engine_batches = Gauge(
            "prism_http_engine_batches",
            "Batches in the engine now; a batch's stats are recorded before it leaves this count",
            registry=r,
        )

    def observe_batch(self, stats: BatchStats) -> None:
        self.batch_requests.observe(stats.requests)
        self.batch_tokens.observe(stats.tokens)
        self.engine_seconds.observe(stats.engine_seconds)
        for s in stats.queue_seconds:
            self.queue_seconds.observe(s)
        self.thought_tokens.inc(stats.thought_tokens)
        for reason, n in stats.stopped.items():
            self.thoughts_stopped.labels(reason).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample (tests)."""
        got = self.registry.get_sample_value(name, labels or {})
        return 0.0 if got is None else got
