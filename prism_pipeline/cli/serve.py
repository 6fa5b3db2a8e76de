"""`prism serve`: the flags, and the server started from them."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import sys
from pathlib import Path
from typing import Any

from prism_pipeline.cli.engine_flags import add_engine_flags, engine_settings, positive_int, unit_float
from prism_pipeline.serve.server import (
    ServeError,
    SocketLimits,
    draining_server,
    uvicorn_config,
)

API_KEY_ENV = "PRISM_API_KEY"


def _release_date(path: Path) -> str:
    """GGUF files carry no release date; the file's modification day stands in for it."""
    return dt.datetime.fromtimestamp(path.stat().st_mtime, tz=dt.UTC).date().isoformat()


def build_app(args: argparse.Namespace) -> Any:
    """Load the engine named by the parsed flags and build the app (errors: `ServeError`)."""
    from engine.decide.decision_config import DecisionConfigError
    from prism_pipeline.core.engine_setup import load_engine
    from prism_pipeline.serve.app import AppConfig, create_app
    from prism_pipeline.serve.requests import CHARS_PER_TOKEN_BOUND
    from schemas.systemone import Limits

    path = Path(args.model)
    if not path.is_file():
        raise ServeError(f"--model {path}: no such file")
    try:
        # --gate and --thought-budget change the decision config, as under every command (see
        # core.engine_setup); the app then caps a request's gate at that gate by default.
        settings = engine_settings(args, path)
        # The server hands each result over as soon as it is final: no ThoughtWatch wrapper.
        engine = load_engine(settings, watch=False)
    except (DecisionConfigError, ValueError, OSError) as e:
        raise ServeError(f"cannot load {path}: {e}") from None
    token_limit = engine.max_request_tokens
    if args.max_request_tokens is not None:
        token_limit = min(token_limit, args.max_request_tokens)
    names = tuple(dict.fromkeys([args.name or engine.model_name, *args.alias]))
    api_key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    try:
        # The state-size ceiling by default follows the token ceiling (the cheap bound before
        # tokenizing, see serve.requests.CHARS_PER_TOKEN_BOUND), so it is not 25x the tokens it can hold.
        state_chars = args.max_state_chars or token_limit * CHARS_PER_TOKEN_BOUND
        limits = Limits(max_questions=args.max_questions, max_state_chars=state_chars)
    except ValueError as e:
        raise ServeError(str(e)) from None
    config = AppConfig(
        model_names=names,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        limits=limits,
        seed=args.seed,
        batch_tokens=args.batch_tokens,
        max_wait_ms=args.max_wait_ms,
        max_batch_requests=args.max_batch_requests,
        max_pending=args.max_pending,
        release_date=_release_date(path),
        max_gate=args.max_gate,
        deadline_s=args.deadline_s or None,
        max_request_tokens=token_limit,
        body_timeout_s=args.body_timeout_s,
    )
    return create_app(engine, config)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        app = build_app(args)
    except ServeError as e:
        sys.stderr.write(f"prism serve: {e}\n")
        return 2
    limits = SocketLimits(
        max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
        header_timeout_s=args.header_timeout_s,
        max_connections=args.max_connections,
        drain_s=args.drain_s,
    )
    server = draining_server(uvicorn_config(app, args.host, args.port, limits), args.drain_s)
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


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the TypeSafe /v1/systemone HTTP API",
        description="Serve one model over HTTP: POST /v1/systemone, GET /v1/models, /health, /metrics, "
        "/openapi.json. Concurrent requests are batched into engine forests.",
    )
    add_engine_flags(p, model_help="a StartLux-Decision GGUF file")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8090, help="port (default 8090)")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' [{API_KEY_ENV}]")
    p.add_argument("--name", default=None, help="model name reported and accepted (default: the GGUF's name)")
    p.add_argument("--alias", action="append", default=[], help="another accepted model name (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="thought sampling seed (default 0)")
    p.add_argument("--batch-tokens", type=positive_int, default=8192, help="token budget of one batch")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="longest wait to fill a batch (default 5)")
    p.add_argument(
        "--max-batch-requests", type=positive_int, default=64, help="requests per batch (default 64)"
    )
    p.add_argument(
        "--max-pending", type=positive_int, default=1024, help="requests waiting before 503 (default 1024)"
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=16 * 1024 * 1024,
        help="largest request body; larger is 413 (default 16 MiB)",
    )
    p.add_argument(
        "--max-questions", type=positive_int, default=64, help="questions per request (default 64)"
    )
    p.add_argument(
        "--max-state-chars",
        type=positive_int,
        default=None,
        help="characters of state per request (default: 8 per token of --max-request-tokens)",
    )
    g = p.add_argument_group(
        "ceilings", "what one request may cost at most: a client may lower these, never raise them"
    )
    g.add_argument(
        "--max-gate",
        type=unit_float,
        default=None,
        help="highest AutoThink gate a question may ask for (default: the server's gate, so clients "
        "can only lower it; 1 lets them force thoughts, each bounded by --thought-budget)",
    )
    g.add_argument(
        "--deadline-s",
        type=float,
        default=60.0,
        help="per-request deadline: past it, its thoughts stop and it gets 504 (0: none; default 60)",
    )
    g.add_argument(
        "--max-request-tokens",
        type=positive_int,
        default=None,
        help="prompt tokens per request (default and most: the engine's limit)",
    )
    g = p.add_argument_group("sockets", "bounds on a connection before and while the app reads it")
    g.add_argument(
        "--max-header-bytes", type=positive_int, default=16 * 1024, help="request line + headers (16 KiB)"
    )
    g.add_argument("--max-headers", type=positive_int, default=100, help="header fields per request (100)")
    g.add_argument("--header-timeout-s", type=float, default=10.0, help="headers must arrive within (10 s)")
    g.add_argument("--body-timeout-s", type=float, default=30.0, help="the body must arrive within (30 s)")
    g.add_argument("--max-connections", type=positive_int, default=512, help="open connections (512)")
    g.add_argument(
        "--drain-s",
        type=float,
        default=10.0,
        help="SIGTERM: in-flight requests may finish for this long (10 s)",
    )
    p.set_defaults(func=_cmd_serve)
