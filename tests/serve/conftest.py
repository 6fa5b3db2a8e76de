"""Session fixtures: one small generated model, one engine, and real uvicorn servers on free ports.

The decision config beside the model keeps AutoThink on (serving gate 0.6) but caps thoughts at a
few tokens, so a fuzzed question that thinks costs milliseconds, not a 4096-token thought.
Servers share the engine; tests talk to one server at a time, so the engine never sees two callers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from serve_helpers import API_KEY, Served

from engine.engine import Engine
from prism_pipeline.serve.app import AppConfig, create_app
from prism_pipeline.serve.metrics import ServeMetrics
from prism_pipeline.serve.server import ServerThread
from schemas.systemone import Limits


@pytest.fixture(scope="session")
def model_path(tmp_path_factory: pytest.TempPathFactory, gguf_model: Callable[..., Path]) -> Path:
    """The session's tiny Q8_0 model, copied into a folder of its own beside its decision config."""
    root = tmp_path_factory.mktemp("serve_model")
    path = Path(shutil.copyfile(gguf_model("Q8_0", "tiny"), root / "tiny-Q8_0.gguf"))
    (root / "decision_config.json").write_text(json.dumps({"thought_budget": 6}))
    return path


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Engine:
    return Engine.load(model_path)


@pytest.fixture(scope="session")
def serve(engine: Engine) -> Iterator[Callable[[AppConfig], Served]]:
    """`serve(config) -> Served`: start a server (stopped at the end of the session)."""
    running: list[ServerThread] = []

    def start(config: AppConfig) -> Served:
        metrics = ServeMetrics()
        thread = ServerThread(create_app(engine, config, metrics))
        thread.start()
        running.append(thread)
        return Served(thread.url, config, metrics, engine)

    yield start
    for thread in running:
        thread.stop()


@pytest.fixture(scope="session")
def open_server(serve: Callable[[AppConfig], Served]) -> Served:
    """No API key, AutoThink off, and a batching window so concurrent requests share forests."""
    return serve(AppConfig(max_wait_ms=20.0, gate=0.0))


@pytest.fixture(scope="session")
def auth_server(serve: Callable[[AppConfig], Served]) -> Served:
    """API key, a 4 KiB body limit and at most 4 questions per request."""
    return serve(AppConfig(api_key=API_KEY, max_body_bytes=4096, limits=Limits(max_questions=4)))
