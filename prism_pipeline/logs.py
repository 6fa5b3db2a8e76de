"""Process-wide setup: structlog (JSON lines in services, pretty on a TTY) and uvloop."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys

import structlog

_configured = False


def install_stack_dump() -> None:
    """`kill -USR1 <pid>` writes every thread's stack to stderr: how a stuck process says where."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def configure_logging(level: str = "INFO", json: bool | None = None) -> None:
    """Configure structlog once; later calls are no-ops so libraries and tests can call it freely."""
    global _configured
    if _configured:
        return
    if json is None:
        json = not sys.stderr.isatty()
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = True


def install_uvloop() -> bool:
    """Use uvloop's event loop where it is available; returns whether it was installed."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True
