"""Process-wide setup: structlog (JSON lines in services, pretty on a TTY) and uvloop."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys

import structlog

_configured = False

# aiokafka's own messages while a broker (or a topic's leader, or the group coordinator) is still
# starting: retried by the client and harmless, but logged as warnings/errors that read like
# failures. They are shown at INFO through the structlog renderer (`KafkaTransientFilter`).
KAFKA_TRANSIENT = (
    "NotLeaderForPartitionError",
    "GroupCoordinatorNotAvailableError",
    "CoordinatorNotAvailableError",
    "NotCoordinatorForGroupError",
    "CoordinatorLoadInProgressError",
    "LeaderNotAvailableError",
    "UnknownTopicOrPartitionError",
)


class KafkaTransientFilter(logging.Filter):
    """Demote aiokafka's start-up retry messages to INFO (and drop them below the chosen level)."""

    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("aiokafka") and record.levelno > logging.INFO:
            message = record.getMessage()
            if any(name in message for name in KAFKA_TRANSIENT):
                record.levelno, record.levelname = logging.INFO, "INFO"
                record.transient = True
        return record.levelno >= self.level


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
    # Libraries' stdlib logging (aiokafka, uvicorn) goes through the same renderer, with its level
    # and logger name, instead of bare messages on stderr.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    handler.addFilter(KafkaTransientFilter(logging.getLevelName(level)))
    logging.basicConfig(level=level, handlers=[handler])
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
