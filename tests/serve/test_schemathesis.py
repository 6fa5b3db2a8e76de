"""schemathesis fuzzes `prism serve` from its own OpenAPI document (its real CLI, a bounded number of
examples): no 5xx, every status, content type, header and body as the document declares, schema-
violating requests rejected, and auth not ignored. The server under test has an API key and small
limits (4 questions, 4 KiB bodies) so fuzzed requests stay cheap; its AutoThink is on (gate 0.6,
6-token thoughts), so fuzzed per-question gates exercise the thinking path too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_helpers import API_KEY, Served

CHECKS = ",".join([
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "ignored_auth",
    "unsupported_method",
])  # fmt: skip


def test_openapi_document_declares_the_contract(auth_server: Served) -> None:
    # With an API key the document is guarded too (issue #21): the key opens it.
    doc = httpx.get(f"{auth_server.url}/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    op = doc["paths"]["/v1/systemone"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SystemOneRequest"
    }
    assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/SystemOneResponse"
    }
    assert {"400", "401", "404", "413", "415", "422", "503"} <= set(op["responses"])
    schemas = doc["components"]["schemas"]
    assert schemas["SystemOneRequest"]["properties"]["questions"]["maxProperties"] == 4  # the server's limit
    model = schemas["SystemOneRequest"]["properties"]["model"]
    assert model["anyOf"][0]["enum"] == [auth_server.engine.model_name]
    # Each question type names its own criteria shape.
    variants = {v["properties"]["type"]["const"]: v for v in schemas["Question"]["oneOf"]}
    assert variants["score"]["properties"]["criteria"]["type"] == "array"
    assert variants["choice"]["required"] == ["type", "criteria"]
    assert {"Question", "ErrorBody", "NoulAnswer", "ChoiceAnswer", "ScoreAnswer"} <= set(schemas)
    assert op["security"] == [{"HTTPBearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]


@pytest.mark.slow
def test_schemathesis_finds_nothing(auth_server: Served, tmp_path: Path) -> None:
    # A schema-violating body over the server's 4 KiB limit is refused with 413 before it is read:
    # a rejection too, which schemathesis' default list for negative_data_rejection omits.
    config = tmp_path / "schemathesis.toml"
    statuses = ["400", "401", "404", "405", "413", "415", "422"]
    config.write_text(
        f"[checks.negative_data_rejection]\nexpected-statuses = {statuses!r}\n".replace("'", '"')
    )
    cmd = [
        sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()",
        "--config-file", str(config), "run", f"{auth_server.url}/openapi.json",
        "--header", f"Authorization: Bearer {API_KEY}",
        "--checks", CHECKS, "--max-examples", "40", "--seed", "1",
        "--phases", "examples,coverage,fuzzing", "--workers", "1", "--request-timeout", "30",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "generated" in out and " passed" in out
    assert "failed" not in out.split("SUMMARY")[-1].lower(), out[-3000:]
