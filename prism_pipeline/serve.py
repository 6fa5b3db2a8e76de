"""`prism serve`: load one model and serve the TypeSafe `/v1/systemone` API over HTTP.

    prism serve --model m.gguf [--host 127.0.0.1 --port 8090] [--precision auto|int8|bf16|fp32]
                [--api-key KEY | PRISM_API_KEY=KEY] [--decision-config F] [--name N --alias A ...]

uvicorn runs the FastAPI app (`http_app.create_app`) on uvloop; concurrent requests are batched
into engine forests by `http_batching.EngineDispatcher` on one engine thread. `ServerThread` runs
the same server on a background thread (tests, notebooks).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

API_KEY_ENV = "PRISM_API_KEY"


def _release_date(path: Path) -> str:
    """GGUF files carry no release date; the file's modification day stands in for it."""
    return dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.UTC).date().isoformat()


def build_app(args: argparse.Namespace) -> Any:
    """Load the engine named by the parsed flags and build the app (errors: `ServeError`)."""
    from engine.decision_config import DecisionConfigError
    from engine.engine import Engine
    from prism_pipeline.http_app import AppConfig, create_app
    from schemas.systemone import Limits

    path = Path(args.model)
    if not path.is_file():
        raise ServeError(f"--model {path}: no such file")
    precision = None if args.precision == "auto" else args.precision  # None: the engine's default
    try:
        engine = Engine.load(
            path,
            device=args.device,
            precision=precision,
            decision_config=args.decision_config,
            tp=getattr(args, "tp", 1),
        )
    except (DecisionConfigError, ValueError, OSError) as e:
        raise ServeError(f"cannot load {path}: {e}") from None
    names = tuple(dict.fromkeys([args.name or engine.model_name, *args.alias]))
    api_key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    try:
        limits = Limits(max_questions=args.max_questions, max_state_chars=args.max_state_chars)
    except ValueError as e:
        raise ServeError(str(e)) from None
    config = AppConfig(
        model_names=names,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        limits=limits,
        seed=args.seed,
        gate=args.gate,
        thought_budget=args.thought_budget,
        batch_tokens=args.batch_tokens,
        max_wait_ms=args.max_wait_ms,
        max_batch_requests=args.max_batch_requests,
        max_pending=args.max_pending,
        release_date=_release_date(path),
    )
    return create_app(engine, config)


class ServeError(RuntimeError):
    """A configuration problem `prism serve` reports in one line and exits 2 on."""


def uvicorn_config(app: Any, host: str, port: int, **kw: Any) -> Any:
    import uvicorn

    loop = "uvloop" if _has_uvloop() else "asyncio"
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop,
        lifespan="on",
        log_config=None,
        access_log=False,
        server_header=False,
        **kw,
    )


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

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        import socket

        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port))
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


# ---- the CLI ---------------------------------------------------------------------------------------


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        app = build_app(args)
    except ServeError as e:
        sys.stderr.write(f"prism serve: {e}\n")
        return 2
    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, args.host, args.port))
    # uvicorn drains on SIGINT/SIGTERM, then re-raises the signal under the handlers it found: make
    # those no-ops so a graceful stop exits 0 (like `prism run`), not -15 or a KeyboardInterrupt.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        close = getattr(app.state.engine, "close", None)
        if close is not None:
            close()  # tensor parallel: stops the follower ranks
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _unit_float(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the TypeSafe /v1/systemone HTTP API",
        description="Serve one model over HTTP: POST /v1/systemone, GET /v1/models, /health, /metrics, "
        "/openapi.json. Concurrent requests are batched into engine forests.",
    )
    p.add_argument("--model", required=True, help="a StartLux-Decision GGUF file")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8090, help="port (default 8090)")
    p.add_argument("--device", default="cpu", help="engine device (default cpu)")
    p.add_argument(
        "--tp", type=_positive_int, default=1, help="tensor-parallel devices (int8; cuda -> cuda:0..N-1)"
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "int8", "bf16", "fp32"],
        help="auto: int8 on GPU, fp32 on CPU",
    )
    p.add_argument(
        "--decision-config",
        default=None,
        help="decision_config.json (default: the one beside the model, else built-in defaults)",
    )
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' [{API_KEY_ENV}]")
    p.add_argument("--name", default=None, help="model name reported and accepted (default: the GGUF's name)")
    p.add_argument("--alias", action="append", default=[], help="another accepted model name (repeatable)")
    p.add_argument(
        "--gate",
        type=_unit_float,
        default=None,
        help="AutoThink gate for requests (default: the decision config's)",
    )
    p.add_argument(
        "--thought-budget",
        type=_positive_int,
        default=None,
        help="most thought tokens per question (default: the decision config's)",
    )
    p.add_argument("--seed", type=int, default=0, help="thought sampling seed (default 0)")
    p.add_argument("--batch-tokens", type=_positive_int, default=8192, help="token budget of one batch")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="longest wait to fill a batch (default 5)")
    p.add_argument(
        "--max-batch-requests", type=_positive_int, default=64, help="requests per batch (default 64)"
    )
    p.add_argument(
        "--max-pending", type=_positive_int, default=1024, help="requests waiting before 503 (default 1024)"
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=16 * 1024 * 1024,
        help="largest request body; larger is 413 (default 16 MiB)",
    )
    p.add_argument(
        "--max-questions", type=_positive_int, default=64, help="questions per request (default 64)"
    )
    p.add_argument(
        "--max-state-chars",
        type=_positive_int,
        default=1_000_000,
        help="characters of state per request (default 1,000,000)",
    )
    p.set_defaults(func=_cmd_serve)
