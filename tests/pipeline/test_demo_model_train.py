"""The demo model's training is deterministic: two short runs write identical bytes, which the
engine loads and answers with."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipeline.kafkautil import REPO

pytest.importorskip("transformers")


def _train(out: Path) -> bytes:
    subprocess.run(
        [sys.executable, "-m", "ops.train.train_demo_model", "--tiny", "--out", str(out),
         "--events", "12", "--steps", "3", "--batch", "4", "--think-batch", "2", "--threads", "1"],
        cwd=REPO, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out.read_bytes()


def test_two_short_runs_give_identical_bytes(tmp_path: Path) -> None:
    a = _train(tmp_path / "a.gguf")
    b = _train(tmp_path / "b.gguf")
    assert hashlib.sha256(a).hexdigest() == hashlib.sha256(b).hexdigest()

    from engine.engine import Engine
    from engine.types import DecideRequest
    from prism_pipeline import synth
    from schemas.systemone import SystemOneRequest

    engine = Engine.load(tmp_path / "a.gguf", precision="fp32")
    event = next(synth.generate(1, seed=9, split="t"))
    (res,) = engine.decide([DecideRequest("e", SystemOneRequest.model_validate(event["request"]), gate=0.0)])
    assert res.error is None and set(res.answers) == set(event["labels"])


def test_bad_arguments_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ops.train.train_demo_model", "--out", "x.gguf", "--steps", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "steps" in done.stderr
