"""`prism demo` end to end (its own broker, the bundled samples), on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prism_pipeline.demo import sample_events_path
from schemas.deadletter import parse_event
from tests.pipeline.kafkautil import REPO

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_bundled_samples_are_valid_and_varied() -> None:
    lines = sample_events_path().read_bytes().splitlines()
    events = [parse_event(line) for line in lines]
    assert len(events) >= 50
    assert len({e.event_id for e in events}) == len(events)
    assert all(2 <= len(e.request.questions) <= 5 for e in events)
    types = {q.type for e in events for q in e.request.questions.values()}
    assert types == {"noul", "choice", "score"}
    assert any(isinstance(e.request.state, str) for e in events)
    assert any(isinstance(e.request.state, dict) for e in events)
    assert {e.source for e in events} >= {"alert", "ticket"}
    assert json.loads(lines[0])["event_id"] == events[0].event_id


def test_demo_decides_prints_and_verifies(tiny_model: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prism_pipeline.cli",
            "demo",
            "--model",
            str(tiny_model),
            "--limit",
            "4",
            "--gate",
            "0",
            "--cache-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids = [parse_event(line).event_id for line in sample_events_path().read_bytes().splitlines()[:4]]
    table = done.stdout
    for event_id in ids:
        assert event_id in table
    assert "4 events, 4 decision records, 0 dead letters" in table
    assert "replay check: all 4 records re-decided byte for byte identical" in table
