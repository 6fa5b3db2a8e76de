"""Process-level glue for `prism run`: load the engine, run one worker until SIGTERM/SIGINT.

Exit status: 0 drained and stopped; 1 the worker failed (publishing, start-up); 3 the stop passed
its deadline (`--stop-timeout-s`) and in-flight work was abandoned, uncommitted, to the next owner
of its partitions (the `worker.stop_abandoned` log line says what). A process whose event loop
cannot even finish that (an engine call that never returns, a client that ignores cancellation)
is ended by a watchdog thread `FORCE_GRACE_S` later, with the same status and `worker.stop_forced`.

SIGUSR1 logs every asyncio task's await chain (`worker.tasks`) and, as before, every thread's
stack (faulthandler, raw text on stderr): a stuck stop names the task it waits in.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable

import structlog

from prism_pipeline.core.engine_setup import load_engine
from prism_pipeline.core.records import DecisionEngine
from prism_pipeline.logs import install_stack_dump, install_uvloop
from prism_pipeline.worker.loop import CLOSE_GRACE_S, StopAbandoned, Worker, WorkerError
from prism_pipeline.worker.settings import WorkerSettings
from prism_pipeline.worker.taskdump import task_dump

log = structlog.get_logger(__name__)

EXIT_FAILED = 1
EXIT_ABANDONED = 3
# Beyond the stop deadline: the worker's own closes take at most CLOSE_GRACE_S, the engine thread
# its current call; past this the process is ended from a thread, whatever the loop is doing.
FORCE_GRACE_S = CLOSE_GRACE_S + 25.0


def _log_tasks() -> None:
    log.warning("worker.tasks", tasks=task_dump())


async def serve(worker: Worker, on_stop: Callable[[], None] | None = None) -> None:
    """Run `worker` until SIGTERM or SIGINT, then let it drain, publish and commit."""
    loop = asyncio.get_running_loop()

    def stop() -> None:
        worker.request_stop()
        if on_stop is not None:
            on_stop()

    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    usr1 = _install_task_dump(loop)
    try:
        await worker.run()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if usr1:
            faulthandler.unregister(signal.SIGUSR1)
            loop.remove_signal_handler(signal.SIGUSR1)
            install_stack_dump()


def _install_task_dump(loop: asyncio.AbstractEventLoop) -> bool:
    """SIGUSR1: the loop logs the task dump; faulthandler, chained in front, still dumps the
    threads from the signal handler itself, so a loop that is blocked still says where."""
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return False
    faulthandler.unregister(signal.SIGUSR1)  # restores the default, so the loop's handler goes under it
    try:
        loop.add_signal_handler(signal.SIGUSR1, _log_tasks)
    except (NotImplementedError, RuntimeError):
        install_stack_dump()
        return False
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
    return True


class _Watchdog:
    """Ends the process `seconds` after a stop was asked for, if it is still running then."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.seconds, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        # Abandoning is safe here as at the deadline: nothing uncommitted is lost, only redone.
        log.error("worker.stop_forced", seconds=self.seconds, exit_status=EXIT_ABANDONED)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_ABANDONED)


def run_worker(settings: WorkerSettings, engine: DecisionEngine | None = None) -> int:
    """Blocking entry point of `prism run`; returns the process exit code."""
    install_uvloop()
    owned = engine is None
    engine = engine if engine is not None else load_engine(settings)
    worker = Worker(settings, engine)
    watchdog = _Watchdog(settings.stop_timeout_s + FORCE_GRACE_S)
    try:
        asyncio.run(serve(worker, on_stop=watchdog.arm))
    except StopAbandoned:
        return EXIT_ABANDONED  # logged as worker.stop_abandoned
    except WorkerError as e:
        log.error("worker.failed", error=str(e))
        return EXIT_FAILED
    finally:
        close = getattr(engine, "close", None)
        if owned and close is not None:
            close()  # tensor parallel: stops the follower ranks
    return 0
