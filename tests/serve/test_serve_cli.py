"""`prism serve` as a user runs it: a subprocess on a free port, the API key from PRISM_API_KEY,
one real SDK call, then SIGTERM and a clean exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typesafe_sdk import Noul, TypeSafeClient

PRISM = [sys.executable, "-c", "import sys; from prism_pipeline.cli import main; sys.exit(main())"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_path: Path, *extra: str, api_key: str) -> tuple[subprocess.Popen, str]:
    """`prism serve` on a free port with the key from PRISM_API_KEY, once /health answers."""
    port = free_port()
    proc = subprocess.Popen(
        [*PRISM, "serve", "--model", str(model_path), "--port", str(port), "--gate", "0", *extra],
        env={**os.environ, "PRISM_API_KEY": api_key}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read() if proc.stdout else "prism serve exited")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("prism serve did not become healthy")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


@pytest.mark.slow
def test_prism_serve_subprocess(model_path: Path) -> None:
    proc, url = _start(model_path, api_key="cli-key")
    try:
        with TypeSafeClient(base_url=url, api_key="cli-key", model="prism-test-qwen35") as client:
            resp = client.system_one(
                state="Refund me, I paid twice.", questions={"r": Noul(instructions="Refund?")}
            )
        assert 0.0 <= resp.nouls["r"].noul <= 1.0
        assert httpx.post(f"{url}/v1/systemone", json={}).status_code == 401  # the key came from the env
    finally:
        _stop(proc)


def test_prism_serve_reports_a_missing_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*PRISM, "serve", "--model", str(tmp_path / "nope.gguf")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "prism serve: --model" in proc.stderr and "no such file" in proc.stderr
    assert "Traceback" not in proc.stderr


def _serve_answer(model_path: Path, *extra: str) -> float:
    """Start `prism serve` with `extra` flags, ask one yes/no question, stop it; P(yes)."""
    proc, url = _start(model_path, *extra, api_key="tp-key")
    try:
        with TypeSafeClient(base_url=url, api_key="tp-key", model="prism-test-qwen35") as client:
            resp = client.system_one(
                state="db-3 disk 97%, replication lag 40 s", questions={"r": Noul(instructions="Page now?")}
            )
        return resp.nouls["r"].noul
    finally:
        _stop(proc)


@pytest.mark.slow
def test_prism_serve_tp2_answers_the_bits_of_one_process(model_path: Path) -> None:
    """`--tp 2` (two gloo ranks on CPU, int8) gives exactly the single-process int8 probability."""
    one = _serve_answer(model_path, "--precision", "int8")
    two = _serve_answer(model_path, "--precision", "int8", "--tp", "2")
    assert 0.0 < one < 1.0
    assert two.hex() == one.hex()
