"""The job's checkpoint: replaced atomically (temporary file, fsync, rename, fsync the directory),
so a crash leaves the old one or the new one, whole."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import structlog

from prism_pipeline.offline.errors import BackfillError
from prism_pipeline.offline.sinks import fsync_dir

log = structlog.get_logger(__name__)


CHECKPOINT_VERSION = 1


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise BackfillError(f"checkpoint {path} is unreadable ({e}); delete it to start over") from None
    if not isinstance(data, dict) or data.get("version") != CHECKPOINT_VERSION:
        raise BackfillError(f"checkpoint {path} is not a version {CHECKPOINT_VERSION} backfill checkpoint")
    return data


def write_checkpoint(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace the checkpoint: a crash leaves either the old or the new one, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(orjson.dumps(data, option=orjson.OPT_INDENT_2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path)
