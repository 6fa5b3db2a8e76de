"""A bounded hostile-client run against `prism serve` on loopback (issue #21).

    python -m ops.load.hostile [--model M.gguf] [--duration 60] [--out result.json]

Starts `prism serve` (int8, the tiny generated model unless --model) on 127.0.0.1 with thoughts
forced-able (--max-gate 1) but bounded (--thought-budget, --deadline-s), then for `--duration`
seconds runs at once:
- short clients: one gate-0 question each, back to back (their latency is what is reported);
- long clients: eight gate-1 questions (every one thinks to the budget), and long evidence
  (about 10,000 tokens);
- one burst of hostile clients: 16 MiB headers, slow headers, slow bodies, drops mid-body,
  1,000,000-character states, a state nested 254 deep, integers beyond 64 bits, no content type,
  invalid UTF-8, and clients that leave while their request thinks.
Hostile connections stay under the run's connection cap (1,024), so what the cap refuses is
never a well-behaved client (the cap itself is tested in tests/serve/test_serve_hostile.py). The
server's RSS is sampled throughout; at the end /metrics gives every status it answered, and a
SIGTERM during a long thought measures the drain. Everything stays on loopback and is bounded by
--duration (plus the server's start and drain); nothing is retried.

Prints one JSON object (also written to --out): statuses seen by clients and counted by the
server, 5xx counts, short-request latency percentiles, peak RSS, SIGTERM-to-exit seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson

PRISM = [sys.executable, "-c", "import sys; from prism_pipeline.cli import main; sys.exit(main())"]
HOST = "127.0.0.1"  # loopback only, by construction
JSON_HEADERS = {"content-type": "application/json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))], 3)


class Run:
    def __init__(self, url: str, pid: int, duration: float) -> None:
        self.url = url
        self.pid = pid
        self.host, self.port = HOST, int(url.rsplit(":", 1)[1])
        self.end = time.monotonic() + duration
        self.statuses: dict[str, Counter[str]] = {}
        self.short_latency: list[float] = []
        self.rss: list[float] = []

    def note(self, kind: str, status: int | str) -> None:
        self.statuses.setdefault(kind, Counter())[str(status)] += 1

    async def post(self, client: httpx.AsyncClient, kind: str, body: bytes, **kw: Any) -> float:
        t0 = time.monotonic()
        try:
            r = await client.post(f"{self.url}/v1/systemone", content=body, **kw)
            self.note(kind, r.status_code)
        except httpx.HTTPError as e:
            self.note(kind, type(e).__name__)
        return time.monotonic() - t0

    # ---- well-behaved and long clients ----

    async def short_client(self, i: int) -> None:
        async with httpx.AsyncClient(timeout=120, headers=JSON_HEADERS) as c:
            n = 0
            while time.monotonic() < self.end:
                body = {
                    "state": f"host web-{i}-{n} disk 91%",
                    "questions": {"q": {"type": "noul", "gate": 0}},
                }
                self.short_latency.append(await self.post(c, "short", orjson.dumps(body)))
                n += 1

    async def long_thinker(self, i: int) -> None:
        questions = {
            f"q{k}": {"type": "noul", "gate": 1, "instructions": f"Page team {k}?"} for k in range(8)
        }
        async with httpx.AsyncClient(timeout=120, headers=JSON_HEADERS) as c:
            n = 0
            while time.monotonic() < self.end:
                body = {"state": f"disk full on db-{i}-{n}", "questions": questions}
                await self.post(c, "long_thought", orjson.dumps(body))
                n += 1

    async def long_evidence(self) -> None:
        async with httpx.AsyncClient(timeout=120, headers=JSON_HEADERS) as c:
            n = 0
            while time.monotonic() < self.end:
                state = " ".join(f"log line {n} {k} status ok" for k in range(1500))
                body = {"state": state, "questions": {"q": {"type": "noul", "gate": 0}}}
                await self.post(c, "long_evidence", orjson.dumps(body))
                n += 1

    # ---- hostile clients (raw sockets where HTTP clients would be too polite) ----

    async def _raw(self, kind: str, data: bytes, hold: float = 0.0, close_early: bool = False) -> None:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            self.note(kind, type(e).__name__)
            return
        try:
            writer.write(data)
            await writer.drain()
            if close_early:
                self.note(kind, "dropped")
                return
            line = await asyncio.wait_for(reader.readline(), timeout=hold + 60)
            self.note(kind, line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "closed")
        except (OSError, TimeoutError) as e:
            self.note(kind, type(e).__name__)
        finally:
            writer.close()

    async def huge_header(self) -> None:
        pad = b"a" * (16 * 1024 * 1024)
        await self._raw("huge_header", b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + pad + b"\r\n\r\n")

    async def slow_header(self) -> None:
        await self._raw("slow_header", b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\n", hold=30)

    async def slow_body(self) -> None:
        head = b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        await self._raw("slow_body", head + b'content-length: 1000\r\n\r\n{"state":', hold=60)

    async def drop_mid_body(self) -> None:
        head = b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        await self._raw("drop_mid_body", head + b'content-length: 1000\r\n\r\n{"state":', close_early=True)

    async def leave_mid_thought(self, i: int) -> None:
        body = orjson.dumps(
            {"state": f"the client leaves {i}", "questions": {"q": {"type": "noul", "gate": 1}}}
        )
        head = b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        try:
            _, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            self.note("leave_mid_thought", type(e).__name__)
            return
        writer.write(head + b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await asyncio.sleep(2.0)
        writer.close()
        self.note("leave_mid_thought", "left")

    async def bad_bodies(self) -> None:
        q = b'"questions": {"q": {"type": "noul"}}'
        cases = {
            "state_1M_chars": orjson.dumps({"state": "x" * 1_000_000, "questions": {"q": {"type": "noul"}}}),
            "nested_254": b'{"state": ' + b"[" * 254 + b"1" + b"]" * 254 + b", " + q + b"}",
            "int_beyond_64_bits": b'{"state": {"n": 123456789012345678901234567890}, ' + q + b"}",
            "invalid_utf8": b'{"state": "caf\xff", ' + q + b"}",
        }
        async with httpx.AsyncClient(timeout=120) as c:
            for kind, body in cases.items():
                await asyncio.gather(*(self.post(c, kind, body, headers=JSON_HEADERS) for _ in range(8)))
            await asyncio.gather(
                *(self.post(c, "no_content_type", b'{"state": "x", ' + q + b"}") for _ in range(8))
            )

    async def hostile_burst(self) -> None:
        await asyncio.sleep(3.0)  # let the long clients get going
        await asyncio.gather(
            *(self.huge_header() for _ in range(20)),
            *(self.slow_header() for _ in range(150)),
            *(self.slow_body() for _ in range(150)),
            *(self.leave_mid_thought(i) for i in range(10)),
            self.bad_bodies(),
            self.drop_waves(),
        )

    async def drop_waves(self) -> None:
        """500 drops mid-body, 100 at a time (with the slow clients, under the connection cap)."""
        for _ in range(5):
            await asyncio.gather(*(self.drop_mid_body() for _ in range(100)))
            await asyncio.sleep(0.5)

    async def sample_rss(self) -> None:
        while time.monotonic() < self.end + 5:
            if (rss := _rss_mib(self.pid)) is not None:
                self.rss.append(rss)
            await asyncio.sleep(0.5)

    async def run(self, short: int, long: int, evidence: bool = True, hostile: bool = True) -> None:
        await asyncio.gather(
            *(self.short_client(i) for i in range(short)),
            *(self.long_thinker(i) for i in range(long)),
            *([self.long_evidence()] if evidence else []),
            *([self.hostile_burst()] if hostile else []),
            self.sample_rss(),
        )


def _server_statuses(url: str) -> dict[str, int]:
    out: Counter[str] = Counter()
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("prism_http_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            status = labels.split('status="', 1)[1].split('"', 1)[0]
            out[status] += int(float(value))
    return dict(sorted(out.items()))


def _metric(url: str, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _sigterm_drain(proc: subprocess.Popen, url: str, drain_s: float) -> dict[str, Any]:
    """SIGTERM while a request thinks; seconds to exit, and what that request got."""
    import threading

    got: dict[str, Any] = {}
    body = orjson.dumps(
        {"state": "a long thought at shutdown", "questions": {"q": {"type": "noul", "gate": 1}}}
    )

    def send() -> None:
        try:
            got["status"] = httpx.post(
                f"{url}/v1/systemone", content=body, headers=JSON_HEADERS, timeout=120
            ).status_code
        except httpx.HTTPError as e:
            got["status"] = type(e).__name__

    t = threading.Thread(target=send)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=drain_s + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    t.join(30)
    return {
        "exit_s": round(time.monotonic() - t0, 2),
        "returncode": proc.returncode,
        "request": got.get("status"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: generate the tiny test model)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--short-clients", type=int, default=4)
    ap.add_argument("--long-clients", type=int, default=2)
    ap.add_argument("--thought-budget", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=20.0)
    ap.add_argument("--drain-s", type=float, default=5.0)
    ap.add_argument("--no-long-evidence", action="store_true", help="no long-evidence client")
    ap.add_argument("--no-hostile", action="store_true", help="no hostile burst (a baseline run)")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="prism-hostile-"))
    model = Path(args.model) if args.model else None
    if model is None:
        from engine.testing.make_model import make_model

        model = make_model(tmp / "tiny-Q8_0.gguf", "Q8_0", "tiny")
    port = _free_port()
    url = f"http://{HOST}:{port}"
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 (closed at the end)
    proc = subprocess.Popen(
        [*PRISM, "--log-json", "serve", "--model", str(model), "--host", HOST, "--port", str(port),
         "--precision", "int8", "--gate", "0", "--max-gate", "1",
         "--thought-budget", str(args.thought_budget),
         "--deadline-s", str(args.deadline_s), "--drain-s", str(args.drain_s), "--body-timeout-s", "5",
         "--max-connections", "1024"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PRISM_API_KEY": ""},
    )  # fmt: skip
    try:
        end = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"prism serve exited: see {tmp / 'serve.log'}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise SystemExit("prism serve did not become healthy")
            time.sleep(0.2)
        run = Run(url, proc.pid, args.duration)
        t0 = time.monotonic()
        asyncio.run(
            run.run(args.short_clients, args.long_clients, not args.no_long_evidence, not args.no_hostile)
        )
        wall = time.monotonic() - t0
        server = _server_statuses(url)
        stopped = _metric(url, "prism_http_requests_stopped_total")
        health_ok = httpx.get(f"{url}/health", timeout=30).status_code == 200
        drain = _sigterm_drain(proc, url, args.drain_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp / "serve.log").read_text(errors="replace")
    client_5xx = sum(n for c in run.statuses.values() for s, n in c.items() if s.startswith("5"))
    result = {
        "wall_s": round(wall, 1),
        "client_statuses": {k: dict(sorted(v.items())) for k, v in sorted(run.statuses.items())},
        "server_statuses": server,
        "server_5xx": sum(n for s, n in server.items() if s.startswith("5")),
        "client_5xx": client_5xx,
        "stopped": stopped,
        "short_requests": len(run.short_latency),
        "short_latency_s": {p: _pct(run.short_latency, float(p)) for p in ("50", "90", "99", "100")},
        "rss_mib": {"start": run.rss[0] if run.rss else None, "peak": max(run.rss, default=None),
                    "end": run.rss[-1] if run.rss else None},
        "health_after": health_ok,
        "sigterm": drain,
        "log_lines": text.count("\n"),
        "log_tracebacks": text.count("Traceback"),
        "log": str(tmp / "serve.log"),
    }  # fmt: skip
    out = json.dumps(result, indent=2)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
