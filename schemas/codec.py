"""orjson encoding of the wire models: compact, deterministic, floats exact.

Key order is NOT sorted. Object keys are written in model-field declaration order and dict insertion
order. Sorting would destroy meaning: a choice question's options are shown to the model in the order
of its `criteria` object, and score/choice probabilities follow display order. Determinism instead
comes from construction: every dict is built in a defined order (the event's own order, which
`loads` preserves), so equal models encode to identical bytes, and `dumps(loads(b)) == b` for any
`b` that `dumps` wrote.

Floats: orjson writes the shortest representation that parses back to the same double (and `-0.0`
as `-0.0`), so every finite float round-trips bit for bit. NaN/Infinity never reach the encoder: the
models reject them at validation.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

import orjson
from pydantic import BaseModel

from schemas.systemone import Limits, validation_context

M = TypeVar("M", bound=BaseModel)


def dumps(model: BaseModel) -> bytes:
    """Compact JSON bytes of a model (UTF-8, no whitespace, all fields including nulls)."""
    # mode="json" lets pydantic render datetimes (ISO 8601, "Z" for UTC) so orjson sees plain types only.
    return orjson.dumps(model.model_dump(mode="json"))


@overload
def loads(data: bytes | str, model: None = None, *, limits: Limits | None = None) -> Any: ...
@overload
def loads(data: bytes | str, model: type[M], *, limits: Limits | None = None) -> M: ...
def loads(data: bytes | str, model: type[M] | None = None, *, limits: Limits | None = None) -> M | Any:
    """Parse JSON; with `model`, validate it (strictly, under `limits`).

    For untrusted event bytes use `schemas.deadletter.parse_event`, which also rejects duplicate keys
    and reports a dead-letter reason.
    """
    obj = orjson.loads(data)
    if model is None:
        return obj
    return model.model_validate(obj, context=validation_context(limits))
