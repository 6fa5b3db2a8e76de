"""The HTTP server of `prism serve` (its flags and the app's setup are in `cli/serve.py`).

uvicorn runs the FastAPI app (`serve.app.create_app`) on uvloop; concurrent requests are batched
into engine forests by `serve.dispatcher.EngineDispatcher` on one engine thread. `ServerThread` runs
the same server on a background thread (tests, notebooks).

Sockets are bounded before the app sees a byte (`SocketLimits`, enforced by a subclass of
uvicorn's httptools protocol): request line plus headers at most `max_header_bytes` and
`max_headers` (else 431), all of them within `header_timeout_s` of the connection or of the
request's first byte (else 408), at most `max_connections` open (else 503 and close). The app
bounds the body's arrival (`AppConfig.body_timeout_s`). On SIGTERM the server stops accepting,
refuses new requests, lets in-flight ones finish for `drain_s`, then cuts their thoughts in the
engine (they get 503) and exits; uvicorn's own graceful timeout is only a backstop behind that.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class ServeError(RuntimeError):
    """A configuration problem `prism serve` reports in one line and exits 2 on."""


@dataclass(frozen=True)
class SocketLimits:
    """What one connection may hold before the app runs (see the module docstring)."""

    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    max_connections: int = 512
    drain_s: float = 10.0  # SIGTERM: how long in-flight requests may still finish
    keep_alive_s: float = 5.0


def uvicorn_config(app: Any, host: str, port: int, limits: SocketLimits | None = None, **kw: Any) -> Any:
    import uvicorn

    lim = limits or SocketLimits()
    loop = "uvloop" if _has_uvloop() else "asyncio"
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop,
        http=guarded_protocol(lim),
        lifespan="on",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_keep_alive=lim.keep_alive_s,
        # A backstop only: the app's drain cuts thoughts at drain_s, so tasks end well before.
        timeout_graceful_shutdown=lim.drain_s + 5.0,
        **kw,
    )


def guarded_protocol(lim: SocketLimits) -> type:
    """uvicorn's httptools protocol with header size/count limits, a header timeout and a cap.

    httptools itself puts no bound on header size and uvicorn none on how long headers may take,
    so without this 20 connections holding 16 MiB of unfinished headers each held 328 MiB.
    """
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _TooLarge(Exception):
        pass

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._guard_timer: Any = None
            self._guard_bytes = 0
            self._guard_count = 0
            self._guard_over = False
            self._in_headers = True
            self._header_raw = 0  # bytes fed while the headers were still incomplete
            self._discarding = False
            if len(self.connections) > lim.max_connections:
                _refusals.note(len(self.connections), lim.max_connections)
                self._refuse(503, "too many connections; retry later")
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._guard_timer is None:
                self._guard_timer = self.loop.call_later(lim.header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if getattr(self, "_guard_timer", None) is not None:
                self._guard_timer.cancel()
                self._guard_timer = None

        def _headers_late(self) -> None:
            self._guard_timer = None
            if not self.transport.is_closing():
                log.info("serve.header_timeout", client=str(self.client), timeout_s=lim.header_timeout_s)
                self._refuse(408, "request headers did not arrive in time")

        def _refuse(self, status: int, message: str, linger_s: float = 0.0) -> None:
            """Answer `status` and close; with `linger_s`, read and drop what the client still sends
            for that long first (a lingering close), so it sees the answer, not a reset."""
            body = message.encode()
            phrase = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}.get(
                status, b"Service Unavailable"
            )
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (status, phrase, len(body), body)
            )
            if linger_s > 0:
                self._discarding = True
                self._disarm()
                self.loop.call_later(linger_s, self.transport.close)
            else:
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._guard_bytes = self._guard_count = 0
            self._in_headers = True
            self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url), 0)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value), 1)
            super().on_header(name, value)

        def _count(self, size: int, headers: int) -> None:
            self._guard_bytes += size
            self._guard_count += headers
            if self._guard_bytes > lim.max_header_bytes or self._guard_count > lim.max_headers:
                self._guard_over = True
                raise _TooLarge  # httptools turns it into HttpParserCallbackError: see send_400_response

        def on_headers_complete(self) -> None:
            self._disarm()
            self._in_headers = False
            self._header_raw = 0
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if self._guard_over:
                limits = f"{lim.max_header_bytes} bytes and {lim.max_headers} headers"
                log.info("serve.headers_too_large", client=str(self.client), limit=limits)
                self._refuse(431, f"request line and headers are limited to {limits}", linger_s=1.0)
            else:
                super().send_400_response(msg)

        def data_received(self, data: bytes) -> None:
            if self._discarding or self.transport.is_closing():
                return
            super().data_received(data)
            # httptools hands a header to on_header only once it is complete, buffering it until
            # then: count what was fed while the headers are still open, so one endless header
            # costs at most the limit plus one read, not whatever the client sends.
            if self._in_headers and not self.transport.is_closing():
                self._header_raw += len(data)
                if self._header_raw > lim.max_header_bytes:
                    self._guard_over = True
                    self.send_400_response("")

    assert issubclass(httptools.HttpParserCallbackError, httptools.HttpParserError)
    return GuardedHttpToolsProtocol


class _Refusals:
    """Connections refused at the cap, logged at most once a second (a flood is one line per second)."""

    def __init__(self) -> None:
        self.count = 0
        self.logged = 0.0

    def note(self, open_now: int, cap: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged >= 1.0:
            log.warning("serve.connections_refused", refused=self.count, open=open_now, cap=cap)
            self.logged = now
            self.count = 0


_refusals = _Refusals()


def draining_server(config: Any, drain_s: float) -> Any:
    """A uvicorn.Server whose shutdown first starts the app's drain (see the module docstring)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            app = self.config.app
            dispatcher = getattr(getattr(app, "state", None), "dispatcher", None)
            if dispatcher is not None:
                dispatcher.begin_drain(drain_s)
            await super().shutdown(sockets)

    return DrainingServer(config)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


class ServerThread:
    """A uvicorn server on a background thread; `with ServerThread(app) as url: ...`.

    `port=0` binds a free loopback port; `url` is `http://host:port`.
    """

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, limits: SocketLimits | None = None
    ) -> None:
        import socket

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        lim = limits or SocketLimits()
        self.server = draining_server(uvicorn_config(app, self.host, self.port, lim), lim.drain_s)
        self._thread = threading.Thread(target=self._run, name="prism-serve", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as e:  # surfaced by start()
            self._error = e

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not start within {timeout} s")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
