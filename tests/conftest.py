"""Shared pytest fixtures."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from engine.testing.make_model import make_model
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

# ---- pytest-xdist: which tests share a worker ----

# Test files that share an expensive session fixture, by group: a group runs whole on one worker,
# so the fixture is built once (the body's decisions are minutes of interpreted kernels).
SHARED_WORKER = {
    "tests/engine/body/test_body_engine.py": "body-decisions",
    "tests/engine/body/test_body_tp.py": "body-decisions",
}


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` (`make test` runs one pytest process per core, `-n`): each test file runs
    whole on one worker (its module fixtures are built once) and the files of a `SHARED_WORKER`
    group together, in collection order, the next one to the first worker free. (xdist's
    `--dist loadgroup` reads marks into node ids in a way pytest 9 no longer allows, so the grouping
    is the scheduler's.) Any other `--dist` is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_WORKER.get(path, path)

    return FileGroupScheduling(config, log)


# ---- a module's own files, gone when its tests are done ----


@pytest.fixture(scope="module")
def module_tmp_path(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Path]:
    """A folder for a module's fixtures (its own model, projector, config) that is removed when the
    module's last test is done. tmp_path_factory's folders live to the end of the session: a dozen
    modules' ~50-140 MB models kept ~1.5 GB on disk to the last test, and a CI machine with little
    free disk ran out mid-suite (ENOSPC in tests/serve, 2026-12-05). What fails stays readable in
    the failing test's own tmp_path (kept by tmp_path_retention_policy = "failed")."""
    root = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    yield root
    shutil.rmtree(root, ignore_errors=True)


# ---- generated models: one file per distinct key per session ----


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`gguf_model(quant="F32", dims="tiny", seed=0, mtp=False, outliers=0) -> Path`.

    Every generated model carries the full 248,320-row vocabulary, so generation costs seconds;
    each distinct file is made once for the whole session and shared by every test directory.
    The files' folder is the session's: a test that needs files beside its model (a
    decision_config.json) copies the model into a folder of its own.
    """
    root = tmp_path_factory.mktemp("gguf_models")
    cache: dict[tuple, Path] = {}

    def get(
        quant: str = "F32", dims: str = "tiny", seed: int = 0, mtp: bool = False, outliers: int = 0
    ) -> Path:
        key = (quant, dims, seed, mtp, outliers)
        if key not in cache:
            name = f"{dims}-{quant}-s{seed}{'-mtp' if mtp else ''}-o{outliers}.gguf"
            cache[key] = make_model(root / name, quant, dims, seed, mtp, outliers)
        return cache[key]

    return get


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
