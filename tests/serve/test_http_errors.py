"""The HTTP contract at its edges: error shapes and statuses, auth, size limits, the request-id
header, /health, /v1/models and /metrics, against a real uvicorn server."""

from __future__ import annotations

import base64
import re

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from serve_helpers import API_KEY, Served, wait_until_engine_is_idle

from schemas.systemone import SystemOneRequest

REQUEST_ID = re.compile(r"^req_[0-9a-f]{32}$")
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD = {
    "state": "The invoice was charged twice.",
    "questions": {"billing": {"type": "noul", "instructions": "Billing?"}},
}


def post(served: Served, body: bytes | dict, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{served.url}/v1/systemone", content=content, headers=hdrs, timeout=60)


def assert_error(r: httpx.Response, status: int, code: str) -> dict:
    """Status, the exact error shape, the request-id header; returns the body."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert REQUEST_ID.match(r.headers["x-typesafe-request-id"])
    body = r.json()
    assert set(body) == {"error", "detail"}
    assert isinstance(body["error"], str) and body["error"]
    assert body["detail"], "every error names at least one location"
    for d in body["detail"]:
        assert set(d) == {"loc", "msg", "type"}
        assert isinstance(d["loc"], list) and all(isinstance(p, str | int) for p in d["loc"])
    assert body["detail"][0]["type"] == code
    return body


# ---- 400 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"{", b"", b"not json", b'{"state": NaN, "questions": {}}'])
def test_bad_json_is_400(open_server: Served, raw: bytes) -> None:
    body = assert_error(post(open_server, raw), 400, "json_invalid")
    assert body["detail"][0]["loc"] == ["body"]


@pytest.mark.parametrize(
    "payload",
    [
        {"state": "x"},  # questions missing
        {"state": "x", "questions": {}},
        {"state": "x", "questions": {"q": {"type": "choice", "criteria": {"only": None}}}},
        {"state": "x", "questions": {"q": {"type": "score", "criteria": ["one"]}}},
        {"state": "x", "questions": {"q": {"type": "maybe"}}},
        {"state": "x", "questions": {"q": {"type": "noul"}}, "extra": 1},
        {"state": "x", "questions": {"q": {"type": "noul", "gate": 2.0}}},
        {"state": "x", "questions": {"q": {"type": "noul"}}, "images": ["%%%"]},
    ],
)
def test_schema_violation_is_400_with_pydantic_locations(open_server: Served, payload: dict) -> None:
    # Oracle: the wire contract's own validator, run here on the same object.
    with pytest.raises(ValidationError) as expected:
        SystemOneRequest.model_validate(payload)
    want = [(["body", *err["loc"]], err["type"]) for err in expected.value.errors(include_url=False)]
    body = assert_error(post(open_server, payload), 400, want[0][1])
    assert [(d["loc"], d["type"]) for d in body["detail"]] == want


def test_repeated_question_id_is_400(open_server: Served) -> None:
    raw = b'{"state":"x","questions":{"a":{"type":"noul"},"a":{"type":"noul"}}}'
    assert_error(post(open_server, raw), 400, "duplicate_keys")


def test_question_limit_is_the_servers(auth_server: Served) -> None:
    qs = {f"q{i}": {"type": "noul", "instructions": "?"} for i in range(5)}
    assert_error(post(auth_server, {"state": "x", "questions": qs}, AUTH), 400, "too_many_questions")
    qs.pop("q4")
    assert post(auth_server, {"state": "x", "questions": qs}, AUTH).status_code == 200


# ---- 401 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": "Bearer"},
    ],
)
def test_missing_or_wrong_key_is_401(auth_server: Served, headers: dict[str, str]) -> None:
    r = post(auth_server, GOOD, headers)
    assert_error(r, 401, "unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(f"{auth_server.url}/v1/models", headers=headers)
    assert_error(r, 401, "unauthorized")


def test_key_opens_the_api_and_health_needs_none(auth_server: Served) -> None:
    assert post(auth_server, GOOD, AUTH).status_code == 200
    assert httpx.get(f"{auth_server.url}/health").status_code == 200
    assert httpx.get(f"{auth_server.url}/v1/models", headers=AUTH).status_code == 200


def test_auth_comes_before_the_body(auth_server: Served) -> None:
    # A stranger learns nothing about the body's problems: 401, not 400.
    assert_error(post(auth_server, b"{", {}), 401, "unauthorized")


# ---- 413 / 415 ------------------------------------------------------------------------------------


def _sized(n: int) -> bytes:
    """A valid request body of exactly n bytes."""
    base = orjson.dumps({**GOOD, "state": ""})
    body = orjson.dumps({**GOOD, "state": "a" * (n - len(base))})
    assert len(body) == n
    return body


def test_body_over_the_limit_is_413(auth_server: Served) -> None:
    limit = auth_server.config.max_body_bytes
    assert post(auth_server, _sized(limit), AUTH).status_code == 200
    assert_error(post(auth_server, _sized(limit + 1), AUTH), 413, "body_too_large")


def test_streamed_body_over_the_limit_is_413(auth_server: Served) -> None:
    # No content-length (chunked): the limit is enforced while reading.
    body = _sized(auth_server.config.max_body_bytes + 1)

    def chunks():
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    r = httpx.post(
        f"{auth_server.url}/v1/systemone",
        content=chunks(),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "body_too_large")


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"content-type": "text/plain"}, "unsupported_media_type"),
        ({"content-type": "multipart/form-data; boundary=x"}, "unsupported_media_type"),
        ({"content-encoding": "gzip"}, "unsupported_encoding"),
    ],
)
def test_non_json_bodies_are_415(open_server: Served, headers: dict[str, str], code: str) -> None:
    assert_error(post(open_server, GOOD, headers), 415, code)


# ---- 404 / 405 / 422 ------------------------------------------------------------------------------


def test_unknown_model_is_404_and_served_names_work(open_server: Served) -> None:
    body = assert_error(post(open_server, {**GOOD, "model": "jev-latest"}), 404, "model_not_found")
    assert body["detail"][0]["loc"] == ["body", "model"]
    r = post(open_server, {**GOOD, "model": open_server.engine.model_name})
    assert r.status_code == 200
    assert r.json()["model"] == open_server.engine.model_name


def test_request_the_engine_rejects_is_422(open_server: Served) -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 16).decode()
    req = {**GOOD, "images": [png]}
    # Oracle: the engine itself, asked directly, refuses the same request.
    from engine.types import DecideRequest

    direct = open_server.engine.decide([DecideRequest("x", SystemOneRequest.model_validate(req))])[0]
    assert direct.error is not None
    body = assert_error(post(open_server, req), 422, "engine_rejected")
    assert direct.error in body["error"]


def test_unknown_path_and_method_use_the_error_shape(open_server: Served) -> None:
    assert_error(httpx.get(f"{open_server.url}/v2/nothing"), 404, "not_found")
    r = httpx.get(f"{open_server.url}/v1/systemone")
    assert_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"


# ---- request ids, health, models, metrics ---------------------------------------------------------


def test_every_response_has_a_fresh_request_id(open_server: Served) -> None:
    responses = [post(open_server, GOOD), post(open_server, b"{"), httpx.get(f"{open_server.url}/health")]
    ids = [r.headers["x-typesafe-request-id"] for r in responses]
    assert all(REQUEST_ID.match(i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_health(open_server: Served) -> None:
    r = httpx.get(f"{open_server.url}/health")
    assert r.status_code == 200
    assert r.json() == {
        "status": "ok",
        "model": open_server.engine.model_name,
        "precision": "fp32",
        "pending": 0,
    }


def test_models_lists_the_served_names(serve) -> None:  # noqa: ANN001 - the conftest factory
    from prism_pipeline.serve.app import AppConfig

    served = serve(AppConfig(model_names=("prism-small", "jev-latest"), release_date="2026-11-01"))
    r = httpx.get(f"{served.url}/v1/models")
    assert r.status_code == 200
    models = r.json()["models"]
    assert [m["name"] for m in models] == ["prism-small", "jev-latest"]
    assert all(m["release_date"] == "2026-11-01" and m["description"] for m in models)
    # An alias is accepted, and the response names the first (canonical) name.
    r = post(served, {**GOOD, "model": "jev-latest"})
    assert r.status_code == 200 and r.json()["model"] == "prism-small"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_requests_and_batches(serve) -> None:  # noqa: ANN001
    from prism_pipeline.serve.app import AppConfig

    served = serve(AppConfig())
    for _ in range(3):
        assert post(served, GOOD).status_code == 200
    assert post(served, b"{").status_code == 400
    wait_until_engine_is_idle(served)  # the last batch's stats are recorded after its answer
    r = httpx.get(f"{served.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = _samples(r.text)
    assert s[("prism_http_requests_total", (("route", "/v1/systemone"), ("status", "200")))] == 3
    assert s[("prism_http_requests_total", (("route", "/v1/systemone"), ("status", "400")))] == 1
    assert s[("prism_http_batch_requests_count", ())] == 3  # sequential requests: one batch each
    assert s[("prism_http_batch_requests_sum", ())] == 3
    assert s[("prism_http_request_seconds_count", (("route", "/v1/systemone"),))] == 4
    assert s[("prism_http_questions_total", (("type", "noul"),))] == 3
