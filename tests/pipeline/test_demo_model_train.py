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


def _start(out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ops.train.train_demo_model", "--tiny", "--out", str(out),
         "--events", "12", "--steps", "3", "--batch", "4", "--think-batch", "2", "--threads", "1"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def test_two_short_runs_give_identical_bytes(tmp_path: Path) -> None:
    # two independent processes (side by side: the suite's 2 cores), the same command
    runs = [(_start(tmp_path / f"{n}.gguf"), tmp_path / f"{n}.gguf") for n in ("a", "b")]
    for proc, _ in runs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    a, b = (path.read_bytes() for _, path in runs)
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


def test_demo_rebuilds_a_missing_model_with_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The recipe's runs chained as `prism demo` chains them (here two short tiny runs).
    import ops.train.train_demo_model as train
    from prism_pipeline import demo

    short = ("--tiny", "--events", "12", "--steps", "2", "--batch", "2", "--think-batch", "1")
    monkeypatch.setattr(
        train, "RECIPE", (("--out", "{next}", *short), ("--out", "{next}", "--init", "{prev}", *short))
    )
    monkeypatch.setattr(demo, "bundled_model_path", lambda: tmp_path / "absent.gguf")
    path = demo.demo_model(tmp_path / "cache")
    assert path == tmp_path / "cache" / "models" / demo.DEMO_MODEL_FILE and path.is_file()
    assert (path.parent / (path.stem + ".stage1")).is_file()  # the first run's output fed the second
    assert demo.demo_model(tmp_path / "cache") == path  # made once, then reused
