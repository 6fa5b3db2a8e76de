"""The OpenAPI document: FastAPI's, with the request schema the app parses itself declared in full
(typed questions, the server's limits, the models it serves)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from schemas.systemone import Limits, SystemOneRequest

_BASE64 = r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?"


def openapi_document(app: FastAPI, limits: Limits, names: tuple[str, ...]) -> dict[str, Any]:
    """FastAPI's document plus the request schema, which FastAPI cannot see (the body is read raw).

    The schema is the wire contract's, with this server's model names and size limits written in,
    so a client (or a fuzzer) reading the document knows what the server accepts.
    """
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schema = SystemOneRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, _typed_question(sub) if name == "Question" else sub)
    props = schema["properties"]
    props["model"] = {
        "anyOf": [{"type": "string", "enum": list(names)}, {"type": "null"}],
        "default": None,
        "description": "a model name from GET /v1/models (null: the served model)",
    }
    props["questions"].update(minProperties=1, maxProperties=limits.max_questions)
    props["questions"]["description"] = f"question id -> question; 1..{limits.max_questions}"
    for branch in props["images"]["anyOf"]:
        if branch.get("type") == "array":
            branch["maxItems"] = limits.max_images
            branch["items"]["pattern"] = rf"^(?:data:image/[A-Za-z0-9.+-]+;base64,)?{_BASE64}$"
    props["images"]["description"] = f"at most {limits.max_images} images, base64 or data: URIs"
    components["SystemOneRequest"] = schema
    app.openapi_schema = doc
    return doc


def _typed_question(question: dict[str, Any]) -> dict[str, Any]:
    """The contract's Question schema, split by `type` so each type names the criteria it takes.

    The pydantic schema lists every criteria shape for every type (the coupling lives in a
    validator, which JSON Schema cannot see); one variant per type says what the server accepts.
    The contract's schema is returned unchanged if its criteria shapes are not the expected three.
    """
    props = question.get("properties", {})
    shapes: dict[str, dict[str, Any]] = {}
    for branch in props.get("criteria", {}).get("anyOf", []):
        if branch.get("type") == "array":
            shapes["score"] = branch
        elif branch.get("type") == "object" and "properties" in branch:
            shapes["noul"] = {"anyOf": [branch, {"type": "null"}]}
        elif branch.get("type") == "object":
            shapes["choice"] = branch
    if set(shapes) != {"noul", "choice", "score"}:
        return question
    variants = []
    for qtype in ("noul", "choice", "score"):
        variant_props = {**props, "type": {"type": "string", "const": qtype}, "criteria": shapes[qtype]}
        variants.append({
            "title": f"{qtype.capitalize()}Question",
            "type": "object",
            "additionalProperties": False,
            "properties": variant_props,
            "required": ["type"] if qtype == "noul" else ["type", "criteria"],
        })  # fmt: skip
    return {"title": "Question", "oneOf": variants}
