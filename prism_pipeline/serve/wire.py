"""The server's own wire shapes (errors, model list, health) and the error every refusal raises:
`{"error": message, "detail": [{"loc", "msg", "type"}]}` with its status and headers."""

from __future__ import annotations

from typing import Literal

import orjson
from fastapi import Response
from pydantic import BaseModel

REQUEST_ID_HEADER = "x-typesafe-request-id"
JSON_TYPE = "application/json"


class ErrorDetail(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorBody(BaseModel):
    error: str
    detail: list[ErrorDetail] = []


class ModelInfo(BaseModel):
    name: str
    description: str
    release_date: str  # YYYY-MM-DD


class ModelList(BaseModel):
    models: list[ModelInfo]


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    precision: str
    pending: int


class ClientGone(Exception):
    """The client disconnected (mid-body, or while its request was decided): nobody reads a reply."""


class APIError(Exception):
    """An error response: status, message and field details (rendered by `error_response`)."""

    def __init__(
        self,
        status: int,
        message: str,
        detail: list[ErrorDetail] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail or []
        self.headers = headers or {}


def api_error(
    status: int, code: str, message: str, loc: list[str | int] | None = None, **headers: str
) -> APIError:
    return APIError(status, message, [ErrorDetail(loc=loc or ["body"], msg=message, type=code)], headers)


def error_response(e: APIError, request_id: str) -> Response:
    body = ErrorBody(error=e.message, detail=e.detail)
    headers = {**e.headers, REQUEST_ID_HEADER: request_id}
    return Response(
        orjson.dumps(body.model_dump()), status_code=e.status, media_type=JSON_TYPE, headers=headers
    )
