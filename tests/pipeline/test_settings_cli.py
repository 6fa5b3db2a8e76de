"""Configuration precedence (flag > PRISM_* environment > default) and clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prism_pipeline.cli import build_parser
from prism_pipeline.cli.run import settings_from_args


def parse(argv: list[str]):
    return settings_from_args(build_parser().parse_args(["run", *argv]))


def test_flags_beat_environment_which_beats_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse([]).batch_tokens == 8192 and parse([]).exactly_once is False
    monkeypatch.setenv("PRISM_BATCH_TOKENS", "1024")
    monkeypatch.setenv("PRISM_EXACTLY_ONCE", "true")
    monkeypatch.setenv("PRISM_GATE", "0.7")
    s = parse([])
    assert (s.batch_tokens, s.exactly_once, s.gate) == (1024, True, 0.7)
    s = parse(["--batch-tokens", "2048", "--gate", "0.9", "--seed-policy", "fixed", "--fixed-seed", "5"])
    assert (s.batch_tokens, s.gate, s.seed_policy, s.fixed_seed) == (2048, 0.9, "fixed", 5)
    assert s.exactly_once is True  # still from the environment


def test_precision_auto_follows_device() -> None:
    assert parse(["--device", "cpu"]).resolved_precision() == "fp32"
    assert parse(["--device", "cuda:0"]).resolved_precision() == "int8"
    assert parse(["--device", "cuda", "--precision", "bf16"]).resolved_precision() == "bf16"


def test_bad_configuration_is_one_clear_line_per_problem() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prism_pipeline.cli", "run", "--gate", "1.5", "--batch-tokens", "0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "--gate" in done.stderr and "--batch-tokens" in done.stderr
    assert "Traceback" not in done.stderr
    same = subprocess.run(
        [sys.executable, "-m", "prism_pipeline.cli", "run", "--input-topic", "t", "--output-topic", "t"],
        capture_output=True,
        text=True,
    )
    assert same.returncode == 2 and "three different topics" in same.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "prism_pipeline.cli", "run", "--model", "/nonexistent/m.gguf"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "model file not found" in missing.stderr
    assert "Traceback" not in missing.stderr
