"""schemathesis fuzzes `prism serve` from its own OpenAPI document (its real CLI, a bounded number of
examples): no 5xx, every status, content type, header and body as the document declares, schema-
violating requests rejected, and auth not ignored. The server under test has an API key and small
limits (4 questions, 4 KiB bodies) so fuzzed requests stay cheap; its AutoThink is on (gate 0.6,
6-token thoughts), so fuzzed per-question gates exercise the thinking path too.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.serve.conftest import API_KEY, Served

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
    doc = httpx.get(f"{auth_server.url}/openapi.json").json()
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
    assert {"Question", "ErrorBody", "NoulAnswer", "ChoiceAnswer", "ScoreAnswer"} <= set(schemas)
    assert op["security"] == [{"HTTPBearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]


@pytest.mark.slow
def test_schemathesis_finds_nothing(auth_server: Served) -> None:
    cmd = [
        sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()",
        "run", f"{auth_server.url}/openapi.json",
        "--header", f"Authorization: Bearer {API_KEY}",
        "--checks", CHECKS, "--max-examples", "40", "--seed", "1",
        "--phases", "examples,coverage,fuzzing", "--workers", "1", "--request-timeout", "30",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "generated" in out and " passed" in out
    assert "failed" not in out.split("SUMMARY")[-1].lower(), out[-3000:]
