"""Prometheus metrics of the HTTP server (`GET /metrics`).

One registry per app, like `WorkerMetrics`: tests start several servers in one process and the
default registry refuses duplicate names.
"""

from __future__ import annotations

from prometheus_client import generate_latest

from prism_pipeline.metric_set import FINE_LATENCY_BUCKETS, SIZE_BUCKETS, MetricSet
from prism_pipeline.serve.dispatcher import BatchStats


class ServeMetrics(MetricSet):
    def __init__(self) -> None:
        super().__init__()
        self.requests = self.counter("prism_http_requests", "HTTP requests answered", ["route", "status"])
        self.latency = self.histogram(
            "prism_http_request_seconds",
            "Wall time from request start to response, per route",
            FINE_LATENCY_BUCKETS,
            ["route"],
        )
        self.queue_seconds = self.histogram(
            "prism_http_queue_seconds",
            "Time a /v1/systemone request waited for its engine batch to start",
            FINE_LATENCY_BUCKETS,
        )
        self.batch_requests = self.histogram(
            "prism_http_batch_requests", "Requests per engine batch", SIZE_BUCKETS
        )
        self.batch_tokens = self.batch_tokens_histogram("prism_http_batch_tokens")
        self.engine_seconds = self.engine_seconds_histogram("prism_http_engine_seconds", FINE_LATENCY_BUCKETS)
        self.questions = self.counter("prism_http_questions", "Questions answered", ["type"])
        self.thought_tokens = self.counter(
            "prism_http_thought_tokens", "Thought tokens generated (answered or cut)"
        )
        self.thoughts_stopped = self.counter(
            "prism_http_requests_stopped",
            "Requests whose thoughts the engine stopped: past their deadline, or cancelled "
            "(client gone, drain)",
            ["reason"],
        )
        self.in_flight = self.gauge("prism_http_in_flight", "/v1/systemone requests being handled")
        self.engine_batches = self.gauge(
            "prism_http_engine_batches",
            "Batches in the engine now; a batch's stats are recorded before it leaves this count",
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
