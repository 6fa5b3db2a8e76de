"""Reading and checking a request body before the engine sees it: the body's arrival (size,
timeout), JSON (UTF-8, duplicate keys, 64-bit integers, depth), the schema (strict pydantic under
the server's `Limits`, exactly like a Kafka event), the cheap bounds before tokenizing, the bearer
key, and the request's event id."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import time
from typing import Any

import orjson
from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from prism_pipeline.core.ceilings import MAX_STATE_DEPTH, nesting_depth, too_deep
from prism_pipeline.serve.wire import JSON_TYPE, APIError, ClientGone, ErrorDetail, api_error
from schemas.deadletter import has_duplicate_keys
from schemas.systemone import Limits, SystemOneRequest, validation_context

# Characters per token above which a state is refused before it is tokenized: byte-level BPE on
# text and JSON runs 2-5 characters per token, so a state longer than 8 per token of the limit is
# over the limit in practice; the exact count still decides everything under this bound.
CHARS_PER_TOKEN_BOUND = 8


def check_bearer(header: str | None, key: str) -> None:
    """The bearer check for routes outside FastAPI's dependencies (docs, schema, metrics)."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise api_error(
            401,
            "unauthorized",
            "missing or invalid API key: send it as 'Authorization: Bearer <key>'",
            ["header", "authorization"],
            **{"www-authenticate": "Bearer"},
        )


def check_depth(obj: Any) -> None:
    """Refuse a body nested deeper than every path can take, before pydantic recurses into it.

    The state may nest MAX_STATE_DEPTH levels (the body adds one); the instructions, a JSON value
    too, no deeper than that.
    """
    if nesting_depth(obj, MAX_STATE_DEPTH + 2) <= MAX_STATE_DEPTH + 1:
        return
    state = obj.get("state") if isinstance(obj, dict) else None
    why = too_deep(state)
    if why is not None:
        raise api_error(422, "state_too_deep", why, ["body", "state"])
    raise api_error(422, "body_too_deep", f"the body nests more than {MAX_STATE_DEPTH + 1} levels deep")


def check_cheap_bounds(req: SystemOneRequest, token_limit: int) -> None:
    """What can be refused before tokenizing: a state far too long for the token limit."""
    chars = len(req.state) if isinstance(req.state, str) else 0
    if not isinstance(req.state, str) and req.state is not None:
        chars = len(orjson.dumps(req.state))
    bound = token_limit * CHARS_PER_TOKEN_BOUND
    if chars > bound:
        raise api_error(
            422,
            "too_many_tokens",
            f"state has {chars} characters: more than {CHARS_PER_TOKEN_BOUND} per token of this "
            f"server's {token_limit}-token limit, so it is refused before tokenizing",
            ["body", "state"],
        )


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise api_error(
            415,
            "unsupported_encoding",
            f"content-encoding {encoding!r} is not supported; send plain JSON",
            ["header", "content-encoding"],
        )
    ctype = request.headers.get("content-type")
    if ctype is None:
        raise api_error(
            415,
            "missing_media_type",
            f"a content-type header is required; send {JSON_TYPE}",
            ["header", "content-type"],
        )
    if ctype is not None:
        mime = ctype.split(";", 1)[0].strip().lower()
        if mime != JSON_TYPE and not mime.endswith("+json"):
            raise api_error(
                415,
                "unsupported_media_type",
                f"content-type {mime!r} is not supported; send {JSON_TYPE}",
                ["header", "content-type"],
            )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise api_error(
            413, "body_too_large", f"body of {int(declared)} bytes is larger than the limit {limit}"
        )
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout_s
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise api_error(
                408, "body_timeout", f"the body did not arrive within {timeout_s} s", connection="close"
            ) from None
        except ClientDisconnect:
            raise ClientGone(f"mid-body, after {size} bytes") from None
        size += len(chunk)
        if size > limit:
            raise api_error(413, "body_too_large", f"body is larger than the limit {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


_LONG_DIGITS = re.compile(rb"\d{19}")  # only bodies with such a run can hold an int beyond 64 bits
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 63) - 1


def check_int(text: str) -> int:
    value = int(text)
    if not _INT_MIN <= value <= _INT_MAX:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise api_error(
            400,
            "integer_out_of_range",
            f"integer {shown} does not fit in 64 bits (signed); send it as a string",
        )
    return value


def json_error(raw: bytes, e: orjson.JSONDecodeError) -> APIError:
    """orjson's message, or for bad UTF-8 (which it reports at 'column 1') the real byte offset."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        bad = raw[u.start : u.end].hex()
        return api_error(
            400, "invalid_utf8", f"body is not valid UTF-8: byte(s) 0x{bad} at byte offset {u.start}"
        )
    return api_error(400, "json_invalid", f"body is not valid JSON: {e}")


def parse_request(raw: bytes, limits: Limits) -> SystemOneRequest:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise json_error(raw, e) from None
    if _LONG_DIGITS.search(raw):  # orjson turns integers beyond 64 bits into floats, silently
        json.loads(raw, parse_int=check_int)
    check_depth(obj)
    if has_duplicate_keys(raw, obj):
        raise api_error(
            400, "duplicate_keys", "an object in the body repeats a key (question ids must be unique)"
        )
    try:
        return SystemOneRequest.model_validate(obj, context=validation_context(limits))
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def validation_error(errors: Any) -> APIError:
    detail = []
    for err in errors:
        loc = [p if isinstance(p, int) else str(p) for p in err.get("loc", ())]
        if not loc or loc[0] != "body":
            loc = ["body", *loc]
        detail.append(
            ErrorDetail(loc=loc, msg=str(err.get("msg", "invalid")), type=str(err.get("type", "invalid")))
        )
    if not detail:
        detail = [ErrorDetail(loc=["body"], msg="invalid request", type="invalid")]
    first = detail[0]
    where = ".".join(str(p) for p in first.loc[1:]) or "body"
    more = f" (and {len(detail) - 1} more)" if len(detail) > 1 else ""
    return APIError(400, f"invalid request: {where}: {first.msg}{more}", detail)


def request_event_id(req: SystemOneRequest) -> str:
    """The id that keys thought sampling: a digest of the evidence alone, so the same state gets the
    same thoughts whatever its companions, its arrival time or its request id."""
    return "http-" + hashlib.sha256(orjson.dumps([req.state, req.images])).hexdigest()[:32]
