"""`prism serve` under hostile clients (issue #21), against a real uvicorn server.

Ceilings a client cannot raise, deadlines and disconnects that stop thoughts inside the engine,
bounded sockets, and every 5xx the probe found turned into a clear 4xx. The tiny model thinks at
a few hundred ms per token on CPU, so "long" requests here are thoughts with a huge budget that
the tests stop after a few steps.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import httpx
import orjson
import pytest
from serve_helpers import API_KEY, Served, wait_until_engine_is_idle

from prism_pipeline.core.ceilings import MAX_STATE_DEPTH
from prism_pipeline.serve.app import AppConfig
from prism_pipeline.serve.server import ServerThread, SocketLimits

Serve = Callable[[AppConfig], Served]
LONG = {"state": "disk full on db-3", "questions": {"q": {"type": "noul", "gate": 1}}}
SHORT = {"state": "disk full on db-3", "questions": {"q": {"type": "noul", "gate": 0}}}
JSON = {"content-type": "application/json"}


def post(
    url: str, body: bytes | dict, headers: dict[str, str] | None = None, timeout: float = 120
) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(
        f"{url}/v1/systemone", content=content, headers={**JSON, **(headers or {})}, timeout=timeout
    )


def code(r: httpx.Response) -> str:
    return r.json()["detail"][0]["type"]


def wait_for(pred: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll until `pred` holds (a safety net against a hang, not a timing assertion)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def thinking(serve: Serve) -> Served:
    """Clients may force thoughts (max_gate 1) with a huge operator budget, cut by a 1 s deadline."""
    return serve(AppConfig(gate=0.0, max_gate=1.0, thought_budget=100_000, deadline_s=1.0, max_wait_ms=1.0))


@pytest.fixture(scope="module")
def leaving(serve: Serve) -> Served:
    """Like `thinking` with no deadline: only the client leaving can stop a thought here (with a
    deadline, a slow machine would let it stop the thought first, and the test see a 504)."""
    return serve(AppConfig(gate=0.0, max_gate=1.0, thought_budget=100_000, deadline_s=None, max_wait_ms=1.0))


# ---- ceilings ---------------------------------------------------------------------------------------


def test_a_client_cannot_raise_the_gate_past_the_server(open_server: Served) -> None:
    """The default ceiling is the server's own gate (0 here): `gate: 1` thinks nothing."""
    r = post(open_server.url, LONG)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == 0


def test_a_forced_thought_gets_at_most_the_operator_budget(serve: Serve) -> None:
    served = serve(AppConfig(gate=0.0, max_gate=1.0, thought_budget=2))
    body = {
        "state": "disk full on db-3",
        "questions": {f"q{i}": {"type": "noul", "gate": 1} for i in range(3)},
    }
    r = post(served.url, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] <= 3 * 2
    oracle = served.engine.decide([
        _oracle(body, gate=0.0, max_gate=1.0, thought_budget=2)
    ])[0]  # fmt: skip
    cut = {q for q, t in oracle.traces.items() if t.thought_truncated}
    assert cut, "a 2-token budget cuts the tiny model's thoughts"
    assert orjson.loads(r.headers["x-prism-thoughts-cut"]) == dict.fromkeys(sorted(cut), "budget")


def _oracle(body: dict, **kw: object):  # type: ignore[no-untyped-def]
    from engine.types import DecideRequest
    from prism_pipeline.serve.requests import request_event_id
    from schemas.systemone import SystemOneRequest

    req = SystemOneRequest.model_validate(body)
    return DecideRequest(request_event_id(req), req, **kw)  # type: ignore[arg-type]


# ---- deadlines and disconnects stop thoughts in the engine ---------------------------------------


def test_past_the_deadline_is_504_and_frees_the_engine(thinking: Served) -> None:
    stopped = thinking.metrics.value("prism_http_requests_stopped_total", {"reason": "deadline"})
    out: dict[str, httpx.Response] = {}
    long = threading.Thread(target=lambda: out.setdefault("long", post(thinking.url, LONG)))
    long.start()
    wait_for(lambda: thinking.metrics.value("prism_http_in_flight") >= 1)
    long.join(120)
    assert out["long"].status_code == 504 and code(out["long"]) == "deadline_exceeded"
    wait_for(
        lambda: thinking.metrics.value("prism_http_requests_stopped_total", {"reason": "deadline"}) > stopped
    )
    assert thinking.metrics.value("prism_http_thought_tokens_total") < 100_000
    # The engine is free: a short request after the stop gets its answer. (Sent during the thought
    # it would race its own 1 s deadline against a thought step on a loaded machine.)
    wait_until_engine_is_idle(thinking)
    short = post(thinking.url, SHORT)
    assert short.status_code == 200, short.text


def test_a_disconnected_clients_thought_stops(leaving: Served) -> None:
    wait_until_engine_is_idle(leaving)
    cancelled = leaving.metrics.value("prism_http_requests_stopped_total", {"reason": "cancelled"})
    gone = leaving.metrics.value("prism_http_requests_total", {"route": "/v1/systemone", "status": "499"})
    body = orjson.dumps({**LONG, "state": "the client leaves"})
    host, port = leaving.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    # Into the engine: its batch claimed, so the engine itself stops it (a request that leaves
    # while still waiting for its batch is dropped by the dispatcher, and never counted stopped).
    wait_for(lambda: leaving.metrics.value("prism_http_engine_batches") >= 1)
    sock.close()
    wait_for(
        lambda: (
            leaving.metrics.value("prism_http_requests_stopped_total", {"reason": "cancelled"}) > cancelled
        )
    )
    wait_for(
        lambda: (
            leaving.metrics.value("prism_http_requests_total", {"route": "/v1/systemone", "status": "499"})
            > gone
        )
    )
    assert (
        leaving.metrics.value("prism_http_requests_total", {"route": "/v1/systemone", "status": "500"}) == 0
    )
    assert post(leaving.url, SHORT).status_code == 200  # the engine is free again


# ---- finding 2: deep nesting ---------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    """A body whose state nests `depth` levels (raw: orjson cannot write the deepest)."""
    return b'{"state": ' + b"[" * depth + b'"x"' + b"]" * depth + b', "questions": {"q": {"type": "noul"}}}'


def test_a_state_nested_too_deep_is_422_not_500(open_server: Served) -> None:
    for depth in (MAX_STATE_DEPTH + 1, 254, 600):
        r = post(open_server.url, nested(depth))
        assert r.status_code == 422 and code(r) == "state_too_deep", r.text
        assert str(MAX_STATE_DEPTH) in r.json()["error"]
    r = post(open_server.url, nested(MAX_STATE_DEPTH))
    assert r.status_code == 200, r.text


# ---- finding 3: bounded sockets ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(engine) -> Served:  # type: ignore[no-untyped-def]
    from prism_pipeline.serve.app import create_app
    from prism_pipeline.serve.metrics import ServeMetrics

    limits = SocketLimits(max_header_bytes=2048, max_headers=20, header_timeout_s=0.5, max_connections=4)
    config = AppConfig(gate=0.0, body_timeout_s=0.5)
    metrics = ServeMetrics()
    thread = ServerThread(create_app(engine, config, metrics), limits=limits)
    thread.start()
    yield Served(thread.url, config, metrics, engine)
    thread.stop()


def _connect(served: Served) -> socket.socket:
    host, port = served.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def _reply(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def test_oversized_and_too_many_headers_are_431(guarded: Served) -> None:
    big = httpx.get(f"{guarded.url}/health", headers={"x-pad": "a" * 4096}, timeout=30)
    assert big.status_code == 431
    many = httpx.get(f"{guarded.url}/health", headers={f"x-h{i}": "1" for i in range(30)}, timeout=30)
    assert many.status_code == 431
    assert httpx.get(f"{guarded.url}/health", timeout=30).status_code == 200


def test_an_endless_header_is_431_without_being_buffered(guarded: Served) -> None:
    """httptools buffers a header until it ends: the raw bytes are counted, not just whole headers."""
    sock = _connect(guarded)
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 200_000)
    assert _reply(sock).startswith(b"HTTP/1.1 431 ")


def test_slow_headers_and_slow_bodies_are_timed_out(guarded: Served) -> None:
    sock = _connect(guarded)
    sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\n")  # and never the end of the headers
    assert _reply(sock).startswith(b"HTTP/1.1 408 ")
    silent = _connect(guarded)  # a connection that sends nothing at all
    assert _reply(silent).startswith(b"HTTP/1.1 408 ")
    sock = _connect(guarded)
    sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 100\r\n\r\n{\"state\":")  # fmt: skip
    reply = _reply(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"body_timeout" in reply


def test_connections_past_the_cap_are_refused(guarded: Served) -> None:
    held = [_connect(guarded) for _ in range(4)]
    try:
        extra = _connect(guarded)
        assert _reply(extra).startswith(b"HTTP/1.1 503 ")
    finally:
        for s in held:
            s.close()
    wait_for(lambda: httpx.get(f"{guarded.url}/health", timeout=30).status_code == 200)


# ---- finding 4: rejected before tokenizing ---------------------------------------------------------------


def test_a_huge_state_is_refused_before_it_is_tokenized(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve(AppConfig(gate=0.0, max_request_tokens=100))
    calls = []
    real = served.engine.count_tokens
    monkeypatch.setattr(served.engine, "count_tokens", lambda req: calls.append(1) or real(req))
    r = post(served.url, {"state": "x" * 801, "questions": {"q": {"type": "noul"}}})
    assert r.status_code == 422 and code(r) == "too_many_tokens" and not calls, r.text
    r = post(served.url, {"state": "disk " * 150, "questions": {"q": {"type": "noul"}}})  # under the bound
    assert r.status_code == 422 and code(r) == "too_many_tokens" and calls, r.text  # the exact count
    assert post(served.url, SHORT).status_code == 200


# ---- finding 5: a client dropping mid-body ---------------------------------------------------------------


def test_a_client_dropping_mid_body_is_499_not_500(open_server: Served) -> None:
    labels = {"route": "/v1/systemone", "status": "499"}
    before = open_server.metrics.value("prism_http_requests_total", labels)
    for _ in range(3):
        sock = _connect(open_server)
        sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{\"state\":")  # fmt: skip
        sock.close()
    wait_for(lambda: open_server.metrics.value("prism_http_requests_total", labels) >= before + 3)
    assert (
        open_server.metrics.value("prism_http_requests_total", {"route": "/v1/systemone", "status": "500"})
        == 0
    )


# ---- finding 6: auth on docs and metrics, ints, content type, UTF-8 ------------------------------------


@pytest.mark.parametrize("path", ["/metrics", "/openapi.json", "/docs", "/redoc"])
def test_the_api_key_guards_docs_and_metrics(auth_server: Served, path: str) -> None:
    assert httpx.get(f"{auth_server.url}{path}", timeout=30).status_code == 401
    ok = httpx.get(f"{auth_server.url}{path}", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert ok.status_code == 200
    assert httpx.get(f"{auth_server.url}/health", timeout=30).status_code == 200  # probes stay open


@pytest.mark.parametrize("number", [b"18446744073709551616", b"9223372036854775808", b"-9223372036854775809"])
def test_integers_beyond_64_bits_are_400(open_server: Served, number: bytes) -> None:
    r = post(open_server.url, b'{"state": {"n": ' + number + b'}, "questions": {"q": {"type": "noul"}}}')
    assert r.status_code == 400 and code(r) == "integer_out_of_range", r.text
    ok = b'{"state": {"n": 9223372036854775807, "s": "12345678901234567890123"}, '
    ok += b'"questions": {"q": {"type": "noul"}}}'
    assert post(open_server.url, ok).status_code == 200


def test_a_content_type_is_required(open_server: Served) -> None:
    r = httpx.post(f"{open_server.url}/v1/systemone", content=orjson.dumps(SHORT), timeout=60)
    assert r.status_code == 415 and code(r) == "missing_media_type"


def test_invalid_utf8_names_the_byte_offset(open_server: Served) -> None:
    raw = b'{"state": "caf\xc3\xa9 \xff", "questions": {"q": {"type": "noul"}}}'
    r = post(open_server.url, raw)
    assert r.status_code == 400 and code(r) == "invalid_utf8"
    offset = raw.index(b"\xff")
    assert f"byte offset {offset}" in r.json()["error"]
