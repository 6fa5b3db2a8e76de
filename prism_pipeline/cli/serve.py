"""`prism serve`: the flags, and the server started from them."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from prism_pipeline.core.engine_setup import PRECISIONS
from prism_pipeline.serve.server import (
    API_KEY_ENV,
    ServeError,
    SocketLimits,
    build_app,
    draining_server,
    uvicorn_config,
)


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
    p.add_argument(
        "--mmproj",
        type=Path,
        default=None,
        metavar="MMPROJ.gguf",
        help="vision projector GGUF (default: mmproj-*.gguf beside --model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8090, help="port (default 8090)")
    p.add_argument("--device", default="cpu", help="engine device (default cpu)")
    p.add_argument(
        "--tp", type=_positive_int, default=1, help="tensor-parallel devices (int8; cuda -> cuda:0..N-1)"
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=PRECISIONS,
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
        default=None,
        help="characters of state per request (default: 8 per token of --max-request-tokens)",
    )
    g = p.add_argument_group(
        "ceilings", "what one request may cost at most: a client may lower these, never raise them"
    )
    g.add_argument(
        "--max-gate",
        type=_unit_float,
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
        type=_positive_int,
        default=None,
        help="prompt tokens per request (default and most: the engine's limit)",
    )
    g = p.add_argument_group("sockets", "bounds on a connection before and while the app reads it")
    g.add_argument(
        "--max-header-bytes", type=_positive_int, default=16 * 1024, help="request line + headers (16 KiB)"
    )
    g.add_argument("--max-headers", type=_positive_int, default=100, help="header fields per request (100)")
    g.add_argument("--header-timeout-s", type=float, default=10.0, help="headers must arrive within (10 s)")
    g.add_argument("--body-timeout-s", type=float, default=30.0, help="the body must arrive within (30 s)")
    g.add_argument("--max-connections", type=_positive_int, default=512, help="open connections (512)")
    g.add_argument(
        "--drain-s",
        type=float,
        default=10.0,
        help="SIGTERM: in-flight requests may finish for this long (10 s)",
    )
    p.set_defaults(func=_cmd_serve)
