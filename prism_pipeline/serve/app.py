"""The TypeSafe-compatible HTTP front end: a FastAPI app over one `Engine`.

Routes: `POST /v1/systemone` (the TypeSafe wire shape, `schemas.systemone`), `GET /v1/models`,
`GET /health`, `GET /metrics`, and the OpenAPI document at `/openapi.json`.

Every response carries an `x-typesafe-request-id` header. Every error body is
`{"error": message, "detail": [{"loc", "msg", "type"}]}`:
- 400: the body is not JSON (invalid UTF-8 names the byte offset), repeats a key, holds an integer
  outside 64 bits, or breaks the schema (`detail` points at the fields);
- 401: an API key is configured and the bearer token is missing or wrong (the key also guards
  `/metrics`, `/docs`, `/redoc` and `/openapi.json`; `/health` stays open for probes);
- 404: the request names a model this server does not serve (or an unknown path);
- 408: the body did not arrive within the body timeout;
- 413: the body is larger than the configured limit;
- 415: no content type, or one other than (uncompressed) JSON;
- 422: a valid request the model cannot answer: too many tokens (a cheap character bound first,
  the exact count after), a state nested too deep, or the engine rejected it;
- 503: too many requests waiting, or shutting down (with `retry-after`);
- 504: the request passed the server's deadline; its thoughts were stopped in the engine.

Operator ceilings (`AppConfig`): a question's `gate` is capped at `max_gate` (by default the
server's gate, so clients may lower it and never force a thought), thoughts at the server's
budget, requests at `deadline_s`. A response whose thoughts hit the budget says so in the
`x-prism-thoughts-cut` header (a JSON map question id -> "budget"). A client that disconnects
while its request is decided has its thoughts stopped; that is logged as one line
(`serve.client_gone`) and counted under status 499, never as a server error.

The body is read and checked by `serve.requests` rather than by FastAPI, so it is checked exactly
like a Kafka event (strict pydantic under the server's `Limits`, orjson, duplicate keys refused);
`serve.openapi` still declares the request schema, and `serve.wire` holds the error shapes. What
stays here (about 400 lines) is the routes and the order each request goes through, kept in one
place because that order (auth, bounds, tokens, ceilings, deadline, answer) is the contract.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
import structlog
from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.types import INVALID_IMAGE, CancelToken, DecideRequest, DecideResult, ImageError
from prism_pipeline.core.ceilings import Ceilings
from prism_pipeline.core.records import DecisionEngine
from prism_pipeline.serve.dispatcher import DispatcherClosed, EngineDispatcher, Overloaded
from prism_pipeline.serve.metrics import ServeMetrics
from prism_pipeline.serve.openapi import openapi_document
from prism_pipeline.serve.requests import (
    check_bearer,
    check_cheap_bounds,
    parse_request,
    read_body,
    request_event_id,
    validation_error,
)
from prism_pipeline.serve.wire import (
    JSON_TYPE,
    REQUEST_ID_HEADER,
    APIError,
    ClientGone,
    ErrorBody,
    Health,
    ModelInfo,
    ModelList,
    api_error,
    error_response,
)
from schemas.systemone import Limits, SystemOneResponse, Usage

log = structlog.get_logger(__name__)

THOUGHTS_CUT_HEADER = "x-prism-thoughts-cut"
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": logged and counted, never a 5xx
# Answering a request waits this much past its deadline for the engine's own stop (one thought
# step) before the handler gives up on it (the engine still stops it at its next step).
DEADLINE_GRACE_S = 0.5
_PROTECTED = frozenset({"/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
API_VERSION = "1.0.0"
# Module level: FastAPI resolves the (string) annotations of dependencies in module globals.
_BEARER = HTTPBearer(auto_error=False, description="The server's API key as a bearer token")


# ---- configuration ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AppConfig:
    """What the app needs besides the engine (the CLI builds it from flags)."""

    model_names: tuple[str, ...] = ()  # accepted `model` values; the first is reported. () = engine name
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    limits: Limits = field(default_factory=Limits)
    seed: int = 0
    gate: float | None = None  # None: the engine's decision-config gate
    thought_budget: int | None = None  # None: the engine's decision-config budget
    batch_tokens: int = 8192
    max_wait_ms: float = 5.0
    max_batch_requests: int = 64
    max_pending: int = 1024
    release_date: str = "1970-01-01"
    description: str = ""
    # Ceilings (see the module docstring). max_gate None: the server's gate (clients lower only).
    max_gate: float | None = None
    deadline_s: float | None = 60.0
    max_request_tokens: int | None = None  # None: the engine's own limit
    body_timeout_s: float = 30.0  # the whole body must arrive within this, or 408


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "model": ErrorBody,
        "description": "Malformed body: not JSON, a repeated key, or a schema violation",
    },
    401: {"model": ErrorBody, "description": "Missing or wrong bearer token"},
    404: {"model": ErrorBody, "description": "The requested model is not served here"},
    413: {"model": ErrorBody, "description": "Body larger than the server's limit"},
    415: {"model": ErrorBody, "description": "Not an uncompressed JSON body"},
    408: {"model": ErrorBody, "description": "The body did not arrive within the body timeout"},
    422: {"model": ErrorBody, "description": "A valid request the model cannot answer (tokens, depth)"},
    503: {"model": ErrorBody, "description": "Too many requests waiting, or shutting down; retry later"},
    504: {"model": ErrorBody, "description": "Past the server's deadline; the request's thoughts stopped"},
}


# ---- the app ---------------------------------------------------------------------------------------


def create_app(
    engine: DecisionEngine, config: AppConfig | None = None, metrics: ServeMetrics | None = None
) -> FastAPI:
    cfg = config or AppConfig()
    names = cfg.model_names or (engine.model_name,)
    served = names[0]
    metrics = metrics or ServeMetrics()
    dispatcher = EngineDispatcher(
        engine,
        max_tokens=cfg.batch_tokens,
        max_wait_s=cfg.max_wait_ms / 1000.0,
        max_requests=cfg.max_batch_requests,
        max_pending=cfg.max_pending,
        on_batch=metrics.observe_batch,
    )
    metrics.engine_batches.set_function(lambda: dispatcher.in_engine)
    dc = engine.decision_config
    ceilings = Ceilings(
        max_gate=(cfg.gate if cfg.gate is not None else dc.gate) if cfg.max_gate is None else cfg.max_gate,
        max_thought_budget=cfg.thought_budget if cfg.thought_budget is not None else dc.thought_budget,
        deadline_s=cfg.deadline_s,
    )
    engine_limit = getattr(engine, "max_request_tokens", None)
    token_limit = min(x for x in (cfg.max_request_tokens, engine_limit, 1 << 62) if x is not None)
    # Tokenizing a large state takes a while: off the event loop, and off the engine thread so
    # counting the next request overlaps the current batch (the HF tokenizer is thread-safe).
    token_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prism-tokens")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await dispatcher.start()
        log.info("serve.ready", model=served, precision=engine.precision, auth=cfg.api_key is not None)
        try:
            yield
        finally:
            await dispatcher.stop()
            token_pool.shutdown(wait=True)
            log.info("serve.stopped")

    app = FastAPI(
        title="Prism",
        version=API_VERSION,
        description="TypeSafe `/v1/systemone`-compatible typed decisions from a StartLux-Decision model.",
        lifespan=lifespan,
    )
    app.state.dispatcher = dispatcher
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.ceilings = ceilings

    async def check_key(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]) -> None:
        given = creds.credentials if creds is not None else ""
        # compare_digest on bytes: constant time, and no TypeError for non-ASCII tokens.
        if not hmac.compare_digest(given.encode(), (cfg.api_key or "").encode()):
            raise api_error(
                401,
                "unauthorized",
                "missing or invalid API key: send it as 'Authorization: Bearer <key>'",
                ["header", "authorization"],
                **{"www-authenticate": "Bearer"},
            )

    auth = [Depends(check_key)] if cfg.api_key is not None else []

    # ---- middleware and error handlers ----

    @app.middleware("http")
    async def request_id_and_metrics(request: Request, call_next: Any) -> Response:
        request_id = "req_" + uuid.uuid4().hex
        request.state.request_id = request_id
        route = request.url.path if request.url.path in _ROUTES else "other"
        t0 = time.perf_counter()
        try:
            if cfg.api_key is not None and request.url.path in _PROTECTED:
                check_bearer(request.headers.get("authorization"), cfg.api_key)
            response: Response = await call_next(request)
        except APIError as e:
            response = error_response(e, request_id)
        except Exception as e:  # a bug: answer with the error shape, never a bare traceback
            log.exception("serve.unhandled", request_id=request_id, error=f"{type(e).__name__}: {e}")
            response = error_response(api_error(500, "internal_error", "internal server error"), request_id)
        response.headers[REQUEST_ID_HEADER] = request_id
        metrics.latency.labels(route).observe(time.perf_counter() - t0)
        metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> Response:
        return error_response(e, _request_id(request))

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, e: ClientGone) -> Response:
        log.info("serve.client_gone", request_id=_request_id(request), path=request.url.path, when=str(e))
        return Response(status_code=CLIENT_GONE_STATUS)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        err = api_error(e.status_code, code, str(e.detail), ["path"], **(e.headers or {}))
        return error_response(err, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> Response:
        return error_response(validation_error(e.errors()), _request_id(request))

    # ---- routes ----

    @app.post(
        "/v1/systemone",
        response_model=SystemOneResponse,
        responses=_ERRORS,
        dependencies=auth,
        summary="Answer typed questions (noul = yes/no, choice, score) about a state",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {JSON_TYPE: {"schema": {"$ref": "#/components/schemas/SystemOneRequest"}}},
            }
        },
    )
    async def systemone(request: Request) -> Response:
        arrived = time.monotonic()
        raw = await read_body(request, cfg.max_body_bytes, cfg.body_timeout_s)
        req = parse_request(raw, cfg.limits)
        if req.model is not None and req.model not in names:
            raise api_error(
                404,
                "model_not_found",
                f"model {req.model!r} is not served here (serving: {', '.join(names)})",
                ["body", "model"],
            )
        check_cheap_bounds(req, token_limit)
        loop = asyncio.get_running_loop()
        try:
            tokens = await loop.run_in_executor(token_pool, engine.count_tokens, req)
        except ImageError as e:  # checks every image (header bounds first) before it is batched
            raise api_error(422, "invalid_image", f"unusable image: {e}", ["body", "images"]) from None
        except ValueError as e:
            raise api_error(422, "engine_rejected", f"the model cannot take this request: {e}") from None
        if tokens > token_limit:
            raise api_error(
                422,
                "too_many_tokens",
                f"request needs {tokens} tokens, more than this server's {token_limit}",
            )
        decide_req = DecideRequest(
            request_id=request_event_id(req),
            request=req,
            seed=cfg.seed,
            gate=cfg.gate,
            thought_budget=cfg.thought_budget,
            cancel=CancelToken(),
        )
        decide_req = ceilings.apply(decide_req, arrived)
        metrics.in_flight.inc()
        try:
            result = await _decide_unless_stopped(request, dispatcher, decide_req, tokens)
        except Overloaded as e:
            raise api_error(503, "overloaded", f"server busy: {e}", **{"retry-after": "1"}) from None
        except DispatcherClosed as e:
            raise api_error(503, "shutting_down", str(e), **{"retry-after": "1"}) from None
        except ValueError as e:
            raise api_error(422, "engine_rejected", f"the model cannot answer this request: {e}") from None
        finally:
            metrics.in_flight.dec()
        if result.stopped == "deadline":
            raise _deadline_error(cfg.deadline_s)
        if result.stopped == "cancelled":
            if dispatcher.draining:
                raise api_error(503, "shutting_down", "the server stopped this request to shut down")
            raise ClientGone("while its request was decided")
        return _answer(result, served, metrics)

    @app.get(
        "/v1/models",
        response_model=ModelList,
        responses={401: _ERRORS[401]},
        dependencies=auth,
        summary="The model names this server accepts",
    )
    async def models() -> ModelList:
        desc = cfg.description or (
            f"StartLux-Decision model {engine.model_name} ({engine.precision}, "
            f"sha256 {engine.model_digest[:12]}) served by Prism"
        )
        return ModelList(
            models=[ModelInfo(name=n, description=desc, release_date=cfg.release_date) for n in names]
        )

    @app.get("/health", response_model=Health, summary="Liveness: the engine is loaded")
    async def health() -> Health:
        return Health(status="ok", model=served, precision=engine.precision, pending=dispatcher.pending)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}
        },
        summary="Prometheus metrics: request latency, batch sizes, engine time",
    )
    async def prometheus() -> Response:  # with an API key, the middleware asks for it first
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.openapi = lambda: openapi_document(app, cfg.limits, names)  # type: ignore[method-assign]
    return app


def _deadline_error(deadline_s: float | None) -> APIError:
    return api_error(
        504,
        "deadline_exceeded",
        f"the request was not decided within the server's deadline of {deadline_s} s; its thoughts "
        "were stopped",
    )


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (its body was read already: only disconnects remain)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _decide_unless_stopped(
    request: Request, dispatcher: EngineDispatcher, decide_req: DecideRequest, tokens: int
) -> DecideResult:
    """The dispatcher's answer, unless the client leaves or the deadline passes first.

    Either way (and when the server cancels this handler at shutdown) the request's cancel token
    is set, so the engine stops its thoughts at the next step instead of working for nobody.
    """
    assert decide_req.cancel is not None
    job = asyncio.ensure_future(dispatcher.decide(decide_req, tokens))
    gone = asyncio.ensure_future(_client_gone(request))
    timeout = None
    if decide_req.deadline is not None:
        timeout = max(0.0, decide_req.deadline - time.monotonic()) + DEADLINE_GRACE_S
    try:
        done, _ = await asyncio.wait({job, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            decide_req.cancel.cancel()
            job.cancel()
    if job in done:
        return job.result()
    if gone in done:
        raise ClientGone("while its request was decided")
    raise _deadline_error(None if decide_req.deadline is None else round(timeout or 0.0, 3))


_ROUTES = frozenset({"/v1/systemone", "/v1/models", "/health", "/metrics", "/openapi.json", "/docs"})


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "req_" + uuid.uuid4().hex


def _answer(result: DecideResult, served: str, metrics: ServeMetrics) -> Response:
    if result.error is not None and result.error.startswith(INVALID_IMAGE):
        raise api_error(422, "invalid_image", f"unusable image: {result.error}", ["body", "images"])
    if result.error is not None:
        raise api_error(422, "engine_rejected", f"the model cannot answer this request: {result.error}")
    body = SystemOneResponse(
        model=served,
        answers=result.answers,
        usage=Usage(input_tokens=result.input_tokens, output_tokens=result.output_tokens),
    )
    for answer in result.answers.values():
        metrics.questions.labels(answer.type).inc()
    cut = {qid: "budget" for qid, t in result.traces.items() if t.thought_truncated}
    headers = {THOUGHTS_CUT_HEADER: json.dumps(cut, separators=(",", ":"))} if cut else None
    return Response(orjson.dumps(body.model_dump(mode="json")), media_type=JSON_TYPE, headers=headers)
