"""Shared pytest fixtures."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from prism_pipeline.local_kafka import LocalKafka

# One intra-op thread: the tests' tensors are tiny and the token-by-token reference loops run
# thousands of small ops, where a second thread costs more than it gives (on CI's 2 cores
# especially when a broker and worker subprocesses share them). PRISM_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("PRISM_TEST_THREADS", "1")))

# No timing in verdicts: hypothesis' defaults fail an example slower than 200 ms (`deadline`) and
# a strategy that generates slowly (`too_slow`), which on a loaded 2-core CI machine says
# something about the machine, not about Prism. A test's own @settings still sets its example
# count; this profile only removes the clock.
settings.register_profile("prism", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("prism")

# ---- Kafka: one real local broker (ops/kafka) per test session, started on first use ----


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """The session's local broker; tests that use it are marked @pytest.mark.kafka."""
    broker = LocalKafka(tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_broker: LocalKafka) -> str:
    """host:port of the session's local broker."""
    return kafka_broker.bootstrap


@pytest.fixture
def kafka_topic_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Makes topic (or group / transactional id) names unique to this test and call."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:80]

    def make(suffix: str = "t") -> str:
        return f"{base}.{suffix}.{uuid.uuid4().hex[:8]}"

    return make
