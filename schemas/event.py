"""The evidence event: a SystemOne request inside the envelope the pipeline consumes from Kafka."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, BeforeValidator, Field

from schemas.systemone import Gate, StrictModel, SystemOneRequest, schema_error

Source = Literal["ticket", "alert", "other"]
MAX_SEED = 2**63 - 1
MAX_THOUGHT_BUDGET = 65536


def _printable(value: str) -> str:
    # Ids end up in Kafka keys, logs and metric labels: control characters there only cause grief.
    if not value.isprintable():
        raise schema_error("not_printable", "must contain printable characters only")
    return value


def _iso_timestamp(value: Any) -> Any:
    # Lax datetime parsing would also take bare numbers as unix times; the contract says ISO 8601.
    if not isinstance(value, str | datetime):
        raise schema_error("datetime_type", "must be an ISO 8601 date-time string with a timezone")
    return value


EventId = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_printable)]
Tenant = Annotated[str, Field(min_length=1, max_length=128), AfterValidator(_printable)]
# strict=False so the JSON string form also parses in Python mode (orjson hands the validator strings).
Timestamp = Annotated[
    AwareDatetime,
    BeforeValidator(_iso_timestamp),
    Field(strict=False, description="ISO 8601 with a timezone"),
]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


class EvidenceEvent(StrictModel):
    event_id: EventId
    source: Source
    tenant: Tenant
    created_at: Timestamp
    seed: Seed | None = None
    gate: Gate | None = None  # overrides the serving default for every question without its own
    thought_budget: Annotated[int, Field(ge=1, le=MAX_THOUGHT_BUDGET)] | None = None
    request: SystemOneRequest
