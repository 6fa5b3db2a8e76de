"""What the worker's and the HTTP server's Prometheus metrics have in common.

Both measure the same engine batches (how many prompt tokens, how long one engine call took) and
chart them on the same buckets, under their own metric names. Those definitions are written here
once, so the two dashboards cannot drift apart: the help texts and buckets below are part of what
both expose today (tests and ops read them), so change them only on purpose.

Each set owns a registry rather than using the default one: tests and the demo start several
workers or servers in one process, and the default registry refuses a metric name twice.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Items per engine batch (events for the worker, requests for the server).
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Prompt tokens per engine batch, up to the longest contexts the engine takes.
TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# Seconds, 5 ms to 2 min: from one quick engine call up to an event's whole trip through Kafka.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# HTTP answers can take a millisecond or two (a request rejected before it reaches the engine),
# which the coarser buckets would fold into one.
FINE_LATENCY_BUCKETS = (0.001, 0.0025, *LATENCY_BUCKETS)


class MetricSet:
    """A registry of its own, with builders that register every metric on it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, documentation, labels, registry=self.registry)

    def histogram(
        self, name: str, documentation: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def batch_tokens_histogram(self, name: str) -> Histogram:
        """Prompt tokens per engine batch: what an engine call had to read."""
        return self.histogram(name, "Prompt tokens per engine batch", TOKEN_BUCKETS)

    def engine_seconds_histogram(self, name: str, buckets: Sequence[float]) -> Histogram:
        """Wall time of one engine call, apart from the queueing and I/O around it."""
        return self.histogram(name, "Wall time of one engine.decide call", buckets)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample (tests and the demo summary); 0 for one never set, as a
        labelled metric has no sample for a label set before its first use."""
        got = self.registry.get_sample_value(name, labels or {})
        return 0.0 if got is None else got
