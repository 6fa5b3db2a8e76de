"""SIGTERM during a long thought: `prism serve` (a real subprocess) exits within its drain time.

The thought has a 100,000-token budget (hours on CPU): only the drain cutting it in the engine
lets the process exit; the request still gets an answer (503 shutting_down), not a reset.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson

PRISM = [sys.executable, "-c", "import sys; from prism_pipeline.cli import main; sys.exit(main())"]
DRAIN_S = 1.0
LONG = {"state": "disk full on db-3", "questions": {"q": {"type": "noul", "gate": 1}}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_flight(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("prism_http_in_flight "):
            return float(line.split()[1])
    return 0.0


def test_sigterm_during_a_long_thought_exits_within_the_drain(model_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*PRISM, "serve", "--model", str(model_path), "--port", str(port), "--gate", "0", "--max-gate", "1",
         "--thought-budget", "100000", "--deadline-s", "0", "--drain-s", str(DRAIN_S)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        end = time.monotonic() + 180
        while True:  # healthy
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "prism serve did not become healthy"
            time.sleep(0.2)
        out: dict[str, httpx.Response] = {}
        body = orjson.dumps(LONG)
        headers = {"content-type": "application/json"}
        send = threading.Thread(
            target=lambda: out.setdefault(
                "r", httpx.post(f"{url}/v1/systemone", content=body, headers=headers, timeout=120)
            )
        )
        send.start()
        end = time.monotonic() + 60
        while _in_flight(url) < 1:
            assert time.monotonic() < end
            time.sleep(0.05)
        time.sleep(0.5)  # into the thought
        proc.send_signal(signal.SIGTERM)
        # The bound: the drain, one thought step, and process teardown on a loaded 2-core machine.
        log, _ = proc.communicate(timeout=DRAIN_S + 20)
        send.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, log
    assert out["r"].status_code == 503, out["r"].text
    assert out["r"].json()["detail"][0]["type"] == "shutting_down"
    assert "serve.drain_cancelling" in log
