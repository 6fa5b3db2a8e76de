"""Process-level glue for `prism run`: load the engine, run one worker until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from typing import Any

import structlog

from prism_pipeline.core.records import DecisionEngine
from prism_pipeline.logs import install_uvloop
from prism_pipeline.worker.loop import Worker, WorkerError
from prism_pipeline.worker.settings import WorkerSettings

log = structlog.get_logger(__name__)


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


def decision_config_for(settings: WorkerSettings) -> Any:
    """The model's decision config with the worker's gate / thought-budget overrides applied.

    Overrides go into the config (not into each request) so they are covered by the config
    digest every record carries: a replay under a different gate is detected.
    """
    from engine.decision_config import load_decision_config

    cfg = load_decision_config(settings.decision_config or settings.model)
    changes: dict[str, Any] = {}
    if settings.gate is not None:
        changes["gate"] = settings.gate
    if settings.thought_budget is not None:
        changes["thought_budget"] = settings.thought_budget
    return dataclasses.replace(cfg, **changes) if changes else cfg


def load_engine(settings: WorkerSettings) -> DecisionEngine:
    if settings.model is None:
        raise ConfigError("no model: pass --model PATH or set PRISM_MODEL")
    if not settings.model.is_file():
        raise ConfigError(f"model file not found: {settings.model}")
    from engine.engine import Engine
    from prism_pipeline.core.thoughtwatch import ThoughtWatch

    engine = Engine.load(
        settings.model,
        device=settings.device,
        precision=settings.resolved_precision(),
        decision_config=decision_config_for(settings),
        tp=settings.tp,
        mmproj=settings.mmproj,  # None: found beside the model by llama.cpp's naming, or none
    )
    return ThoughtWatch(engine)  # progress while thinking; thoughts that never close are reported


async def serve(worker: Worker) -> None:
    """Run `worker` until SIGTERM or SIGINT, then let it drain, publish and commit."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, worker.request_stop)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    try:
        await worker.run()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def run_worker(settings: WorkerSettings, engine: DecisionEngine | None = None) -> int:
    """Blocking entry point of `prism run`; returns the process exit code."""
    install_uvloop()
    owned = engine is None
    engine = engine if engine is not None else load_engine(settings)
    worker = Worker(settings, engine)
    try:
        asyncio.run(serve(worker))
    except WorkerError as e:
        log.error("worker.failed", error=str(e))
        return 1
    finally:
        close = getattr(engine, "close", None)
        if owned and close is not None:
            close()  # tensor parallel: stops the follower ranks
    return 0
