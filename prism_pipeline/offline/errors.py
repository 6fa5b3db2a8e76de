"""Why an offline job stops: one line, exit 2 at the command line."""

from __future__ import annotations


class OfflineError(RuntimeError):
    """An offline job cannot run as asked (a bad selection, an unknown topic...); the message says why."""


class ReplayError(OfflineError):
    """Replay cannot run as asked; the message says why."""


class ReplayRefused(ReplayError):
    """The records name a model, precision or decision config this replay does not have."""


class BackfillError(OfflineError):
    """The backfill job cannot start or continue; the message says why."""
