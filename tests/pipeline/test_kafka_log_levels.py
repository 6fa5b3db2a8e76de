"""aiokafka's start-up retry messages reach the log at INFO, through the structlog renderer;
its other warnings keep their level."""

from __future__ import annotations

import logging

from prism_pipeline.logs import KafkaTransientFilter


def _record(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_startup_retries_are_info_other_warnings_stay() -> None:
    f = KafkaTransientFilter(logging.INFO)
    retry = _record(
        "aiokafka.producer.sender",
        logging.WARNING,
        "Got error produce response: %s",
        "NotLeaderForPartitionError",
    )
    coord = _record(
        "aiokafka.consumer.group_coordinator",
        logging.ERROR,
        "Group Coordinator Request failed: [Error 15] GroupCoordinatorNotAvailableError",
    )
    real = _record("aiokafka.conn", logging.WARNING, "Connection lost: broker 1 unreachable")
    ours = _record("prism.worker", logging.WARNING, "NotLeaderForPartitionError seen by us")  # not aiokafka's
    assert f.filter(retry) and retry.levelname == "INFO" and retry.levelno == logging.INFO
    assert f.filter(coord) and coord.levelname == "INFO"
    assert f.filter(real) and real.levelno == logging.WARNING
    assert f.filter(ours) and ours.levelno == logging.WARNING
    # below the configured level the demoted messages are dropped, real warnings are not
    quiet = KafkaTransientFilter(logging.WARNING)
    again = _record("aiokafka.producer.sender", logging.WARNING, "NotLeaderForPartitionError, retrying")
    assert not quiet.filter(again)
    assert quiet.filter(_record("aiokafka.conn", logging.WARNING, "Connection lost"))


def test_stdlib_records_render_through_structlog(tmp_path) -> None:
    import subprocess
    import sys

    code = (
        "import logging; from prism_pipeline.logs import configure_logging; configure_logging('INFO', True); "
        "logging.getLogger('aiokafka.cluster').warning('Topic x not found: LeaderNotAvailableError')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[2])},
    )
    import json

    line = json.loads(done.stderr.strip().splitlines()[-1])
    assert line["level"] == "info" and line["logger"] == "aiokafka.cluster"
    assert "LeaderNotAvailableError" in line["event"]
