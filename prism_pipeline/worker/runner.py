"""Process-level glue for `prism run`: load the engine, run one worker until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal

import structlog

from prism_pipeline.core.engine_setup import load_engine
from prism_pipeline.core.records import DecisionEngine
from prism_pipeline.logs import install_uvloop
from prism_pipeline.worker.loop import Worker, WorkerError
from prism_pipeline.worker.settings import WorkerSettings

log = structlog.get_logger(__name__)


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
