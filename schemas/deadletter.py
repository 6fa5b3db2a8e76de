"""Parsing raw event bytes with a precise reason for every rejection, and the dead-letter record.

`parse_event(raw, limits)` is the pipeline's single entry point for untrusted bytes. It returns an
`EvidenceEvent` or raises `InvalidEvent(reason, message, errors)`; `InvalidEvent.to_dead_letter(...)`
turns that into the `DeadLetter` value published on the dead-letter topic with the original bytes.
"""

from __future__ import annotations

import base64
import json
import re
from enum import StrEnum
from typing import Annotated, Any

import orjson
from pydantic import Field, ValidationError

from schemas.event import EvidenceEvent
from schemas.systemone import DEFAULT_LIMITS, Limits, StrictModel, validation_context


class ReasonCode(StrEnum):
    invalid_utf8 = "invalid_utf8"
    invalid_json = "invalid_json"
    duplicate_keys = "duplicate_keys"
    schema_violation = "schema_violation"
    too_many_options = "too_many_options"
    too_few_options = "too_few_options"
    oversized_state = "oversized_state"
    oversized_payload = "oversized_payload"
    unknown_question_type = "unknown_question_type"
    duplicate_question_ids = "duplicate_question_ids"
    too_many_questions = "too_many_questions"
    invalid_image = "invalid_image"
    engine_rejected = "engine_rejected"


# pydantic error type -> reason, in priority order: when several errors are found the first listed here
# names the event's reason (independent of the order pydantic reports them in).
_ERROR_REASONS: dict[str, ReasonCode] = {
    "unknown_question_type": ReasonCode.unknown_question_type,
    "too_many_questions": ReasonCode.too_many_questions,
    "too_many_options": ReasonCode.too_many_options,
    "too_few_options": ReasonCode.too_few_options,
    "oversized_state": ReasonCode.oversized_state,
    "too_many_images": ReasonCode.invalid_image,
    "invalid_image": ReasonCode.invalid_image,
}
MAX_REPORTED_ERRORS = 32  # a dead letter stays small even for a request with thousands of bad fields

Loc = list[str | int]


class ErrorDetail(StrictModel):
    loc: Loc  # path to the offending field, e.g. ["request", "questions", "q1", "criteria"]
    msg: str
    type: str  # pydantic error type, or the reason code for checks made before validation


class DeadLetter(StrictModel):
    reason: Annotated[ReasonCode, Field(strict=False)]  # lax: the JSON string form parses to the enum
    message: str
    errors: list[ErrorDetail]
    original_b64: str  # the original value (possibly truncated: compare its length with original_size)
    original_size: Annotated[int, Field(ge=0)]
    topic: str
    partition: Annotated[int, Field(ge=0)]
    offset: Annotated[int, Field(ge=0)]
    key_b64: str | None = None


class InvalidEvent(ValueError):
    """Raised by `parse_event`; `reason` is the dead-letter reason, `errors` point at the fields."""

    def __init__(self, reason: ReasonCode, message: str, errors: list[ErrorDetail] | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.errors = errors or []

    def to_dead_letter(
        self,
        raw: bytes,
        *,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None = None,
        max_original_bytes: int | None = None,
    ) -> DeadLetter:
        return dead_letter(
            raw,
            self.reason,
            self.message,
            self.errors,
            topic=topic,
            partition=partition,
            offset=offset,
            key=key,
            max_original_bytes=max_original_bytes,
        )


def dead_letter(
    raw: bytes,
    reason: ReasonCode,
    message: str,
    errors: list[ErrorDetail] | tuple[ErrorDetail, ...] = (),
    *,
    topic: str,
    partition: int,
    offset: int,
    key: bytes | None = None,
    max_original_bytes: int | None = None,
) -> DeadLetter:
    """Build a dead letter; `max_original_bytes` truncates the kept original (a broker caps message size)."""
    kept = raw if max_original_bytes is None else raw[:max_original_bytes]
    return DeadLetter(
        reason=reason,
        message=message,
        errors=list(errors),
        original_b64=base64.b64encode(kept).decode("ascii"),
        original_size=len(raw),
        topic=topic,
        partition=partition,
        offset=offset,
        key_b64=None if key is None else base64.b64encode(key).decode("ascii"),
    )


def _loc_text(loc: Loc) -> str:
    if len(loc) > 12:  # deeply nested JSON: keep the message readable, the full loc is in `errors`
        loc = [*loc[:8], "...", *loc[-3:]]
    return ".".join(str(p) for p in loc) or "<event>"


def _fail(reason: ReasonCode, loc: Loc, msg: str) -> InvalidEvent:
    return InvalidEvent(
        reason, f"{_loc_text(loc)}: {msg}", [ErrorDetail(loc=loc, msg=msg, type=reason.value)]
    )


# ---- duplicate keys ---------------------------------------------------------------------------------
# orjson keeps the last of repeated keys silently, so repeats are found by counting. Every ':' in the
# raw bytes is either a key/value separator or a literal ':' inside a string. Without repeats, the parsed
# tree has as many pairs as separators and its strings hold every in-string ':' (plus one per escaped
# "\u003a"); a repeated key drops a pair (and its strings), so the sum falls short. The tree's count is
# taken from orjson's own serialization of it (which writes every ':' of a string as is, one separator
# per pair: a C-speed count, ~15x cheaper than walking the tree in Python, which was a fifth of a
# worker's CPU per event); a tree nested deeper than orjson serializes is walked instead. When the raw
# text has "\u003a" escapes, a regex strips string literals and counts separators exactly. Only when a
# repeat is proven is the document parsed again (slowly) to find where.

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def _raw_pairs(raw: bytes) -> int:
    # '"' and '\\' never occur inside multi-byte UTF-8 sequences, so a bytes regex is exact.
    return _JSON_STRING.sub(b"", raw).count(b":")


def _tree_counts(obj: Any) -> tuple[int, int]:
    """(key/value pairs, ':' characters inside keys and strings) of a parsed JSON tree."""
    pairs = colons = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if type(o) is dict:
            pairs += len(o)
            for k, v in o.items():
                colons += k.count(":")
                if type(v) is str:
                    colons += v.count(":")
                elif type(v) is dict or type(v) is list:
                    stack.append(v)
        elif type(o) is list:
            for v in o:
                if type(v) is str:
                    colons += v.count(":")
                elif type(v) is dict or type(v) is list:
                    stack.append(v)
        elif type(o) is str:
            colons += o.count(":")
    return pairs, colons


def _tree_colons(obj: Any) -> int:
    """Separators plus in-string ':' of a parsed JSON tree (see above)."""
    try:
        return orjson.dumps(obj).count(b":")
    except TypeError:  # deeper than orjson writes (it reads deeper); JSONEncodeError is one too
        pairs, colons = _tree_counts(obj)
        return pairs + colons


def has_duplicate_keys(raw: bytes, obj: Any) -> bool:
    """Whether the JSON text `raw`, parsed (last key wins) into `obj`, repeats a key in some object."""
    if b"\\u003a" in raw or b"\\u003A" in raw:
        return _raw_pairs(raw) != _tree_counts(obj)[0]
    return raw.count(b":") != _tree_colons(obj)


class _PairsDict(dict):
    dups: list[str]


def _pairs_hook(pairs: list[tuple[str, Any]]) -> _PairsDict:
    d = _PairsDict(pairs)
    d.dups = []
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                d.dups.append(k)
            seen.add(k)
    return d


def _find_duplicate(text: str) -> tuple[Loc, str | None]:
    """Path of the first object (document order) with a repeated key, and that key (None: not found)."""
    try:
        doc = json.loads(text, object_pairs_hook=_pairs_hook)
    except RecursionError:  # orjson nests deeper than the stdlib parser; the count already proved a repeat
        return [], None
    stack: list[tuple[Loc, Any]] = [([], doc)]
    while stack:
        loc, o = stack.pop()
        if isinstance(o, _PairsDict):
            if o.dups:
                return loc, o.dups[0]
            stack.extend((loc + [k], v) for k, v in reversed(o.items()))
        elif isinstance(o, list):
            stack.extend((loc + [i], v) for i, v in reversed(list(enumerate(o))))
    raise AssertionError("pair count mismatch without a duplicate key")  # _raw_pairs is exact


# ---- parse_event -----------------------------------------------------------------------------------


def _from_validation_error(exc: ValidationError) -> InvalidEvent:
    raw_errors = exc.errors(include_url=False, include_input=False, include_context=False)
    errors = [
        ErrorDetail(loc=list(e["loc"]), msg=e["msg"], type=e["type"])
        for e in raw_errors[:MAX_REPORTED_ERRORS]
    ]
    types = {e["type"] for e in raw_errors}
    reason = next((r for t, r in _ERROR_REASONS.items() if t in types), ReasonCode.schema_violation)
    lead = next((e for e in errors if _ERROR_REASONS.get(e.type) is reason), errors[0])
    more = len(raw_errors) - 1
    message = f"{_loc_text(lead.loc)}: {lead.msg}" + (
        f" (and {more} more error{'s' * (more > 1)})" if more else ""
    )
    return InvalidEvent(reason, message, errors)


def parse_event(raw: bytes, limits: Limits | None = None) -> EvidenceEvent:
    """Parse and validate one raw event; raise InvalidEvent with the reason code on any problem."""
    limits = limits or DEFAULT_LIMITS
    if len(raw) > limits.max_payload_bytes:
        raise _fail(
            ReasonCode.oversized_payload,
            [],
            f"payload is {len(raw)} bytes, more than the limit {limits.max_payload_bytes}",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(ReasonCode.invalid_utf8, [], f"invalid UTF-8 at byte {e.start}: {e.reason}") from None
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise _fail(ReasonCode.invalid_json, [], f"invalid JSON: {e}") from None
    if has_duplicate_keys(raw, obj):
        loc, key = _find_duplicate(text)
        if key is None:
            raise _fail(
                ReasonCode.duplicate_keys, [], "an object repeats a key (too deeply nested to locate)"
            )
        reason = (
            ReasonCode.duplicate_question_ids
            if loc == ["request", "questions"]
            else ReasonCode.duplicate_keys
        )
        what = "question id" if reason is ReasonCode.duplicate_question_ids else "key"
        raise _fail(reason, loc + [key], f"duplicate {what} {key!r}")
    try:
        return EvidenceEvent.model_validate(obj, context=validation_context(limits))
    except ValidationError as e:
        raise _from_validation_error(e) from None


def classify_invalid(raw: bytes, limits: Limits | None = None) -> InvalidEvent | None:
    """None when `raw` is a valid event, else the InvalidEvent parse_event would raise."""
    try:
        parse_event(raw, limits)
    except InvalidEvent as e:
        return e
    return None
