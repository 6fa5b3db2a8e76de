"""The `/v1/systemone` wire contract: requests (state + typed questions) and answers.

Validation is strict (no string->number coercion, unknown fields rejected, NaN/Infinity rejected) and
the error `type` of every custom check is a stable code that `schemas.deadletter` maps to a dead-letter
reason. Size limits are not hard-coded: pass a `Limits` through the pydantic validation context
(`Model.model_validate(obj, context=validation_context(limits))`); without one the defaults apply.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

QuestionType = Literal["noul", "choice", "score"]
QUESTION_TYPES: tuple[str, ...] = ("noul", "choice", "score")

MIN_CHOICE_OPTIONS, MAX_CHOICE_OPTIONS = 2, 255
MIN_SCORE_LEVELS, MAX_SCORE_LEVELS = 2, 10
NOUL_KEYS = frozenset({"true", "false"})
# Answers carry float probabilities computed by a softmax; 1e-3 is JevBench's "strictly valid" bound,
# loose enough for any float path yet tight enough to catch an unnormalised vector.
PROBABILITY_SUM_TOLERANCE = 1e-3
MAX_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class Limits:
    """Configurable size limits, checked during validation (see module docstring)."""

    max_questions: int = 64
    max_state_chars: int = 1_000_000  # len(state) for strings, else len of its compact JSON
    max_images: int = 8
    max_image_bytes: int = 8 * 1024 * 1024  # decoded size of one image
    max_instruction_chars: int = 8192  # same measure as the state
    max_option_chars: int = 4096  # each option name, option description and score level
    max_payload_bytes: int = 16 * 1024 * 1024  # a whole raw event (checked by parse_event)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{f.name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()


def validation_context(limits: Limits | None = None) -> dict[str, Any]:
    """The pydantic validation context that carries `limits` to the validators."""
    return {"limits": limits or DEFAULT_LIMITS}


def limits_from(info: ValidationInfo) -> Limits:
    ctx = info.context
    if isinstance(ctx, Limits):
        return ctx
    if isinstance(ctx, dict) and isinstance(ctx.get("limits"), Limits):
        return ctx["limits"]
    return DEFAULT_LIMITS


def json_chars(value: Any) -> int:
    """Length in characters of a value as the engine sees it: strings raw, anything else as compact JSON."""
    if isinstance(value, str):
        return len(value)
    try:
        return len(orjson.dumps(value).decode())
    except orjson.JSONEncodeError as e:  # e.g. an int beyond 64 bits: orjson cannot render it either
        raise schema_error("json_value", f"value cannot be rendered as JSON: {e}") from e


def schema_error(code: str, message: str) -> PydanticCustomError:
    """A validation error with a stable `type` code; `message` is final text (never a template)."""
    # pydantic would treat {...} in the message as template fields; escaping is moot without a context
    # (unknown fields stay verbatim), so user text (option names, ...) can go in as it is.
    return PydanticCustomError(code, message)


class StrictModel(BaseModel):
    """Base of every wire model: strict types, no unknown fields, finite floats, immutable."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Gate = Annotated[
    float, Field(ge=0.0, le=1.0, description="AutoThink gate: think when the top probability is below it")
]
QuestionId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)]

_CRITERIA_SCHEMA: dict[str, Any] = {
    "description": (
        "choice: {option: description|null}, 2..255 options, display order; "
        "score: [level, ...] lowest first, 2..10 levels; noul: null or a subset of {true, false}"
    ),
    "anyOf": [
        {
            "type": "object",
            "additionalProperties": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "minProperties": MIN_CHOICE_OPTIONS,
            "maxProperties": MAX_CHOICE_OPTIONS,
            "propertyNames": {"minLength": 1},
        },
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": MIN_SCORE_LEVELS,
            "maxItems": MAX_SCORE_LEVELS,
        },
        {
            "type": "object",
            "properties": {
                "true": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "false": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "additionalProperties": False,
        },
        {"type": "null"},
    ],
}


def _count_error(kind: str, what: str, n: int, lo: int, hi: int) -> PydanticCustomError:
    code = "too_many_options" if n > hi else "too_few_options"
    return schema_error(code, f"{kind} questions need {lo}..{hi} {what}, got {n}")


def _check_text(value: Any, what: str, limit: int, *, nullable: bool) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, str):
        raise schema_error("criteria_shape", f"{what} must be a string")
    if len(value) > limit:
        raise schema_error(
            "option_too_long", f"{what} has {len(value)} characters, more than the limit {limit}"
        )


def _check_choice(criteria: Any, limit: int) -> None:
    if not isinstance(criteria, dict):
        raise schema_error("criteria_shape", "choice criteria must be an object {option: description|null}")
    n = len(criteria)
    if not MIN_CHOICE_OPTIONS <= n <= MAX_CHOICE_OPTIONS:
        raise _count_error("choice", "options", n, MIN_CHOICE_OPTIONS, MAX_CHOICE_OPTIONS)
    for name, desc in criteria.items():
        if not name.strip():
            raise schema_error("empty_option_name", f"choice option names must be non-empty, got {name!r}")
        _check_text(name, f"option name {name[:40]!r}", limit, nullable=False)
        _check_text(desc, f"description of option {name[:40]!r}", limit, nullable=True)


def _check_score(criteria: Any, limit: int) -> None:
    if not isinstance(criteria, list):
        raise schema_error("criteria_shape", "score criteria must be a list of levels, lowest first")
    n = len(criteria)
    if not MIN_SCORE_LEVELS <= n <= MAX_SCORE_LEVELS:
        raise _count_error("score", "levels", n, MIN_SCORE_LEVELS, MAX_SCORE_LEVELS)
    for i, level in enumerate(criteria):
        _check_text(level, f"score level {i}", limit, nullable=False)
        if not level.strip():
            raise schema_error("empty_option_name", f"score level {i} must be non-empty")


def _check_noul(criteria: Any, limit: int) -> None:
    if criteria is None:
        return
    if not isinstance(criteria, dict) or not set(criteria) <= NOUL_KEYS:
        raise schema_error(
            "criteria_shape", 'noul criteria must be null or an object with keys "true" and/or "false"'
        )
    for key, desc in criteria.items():
        _check_text(desc, f"noul description {key!r}", limit, nullable=True)


_CRITERIA_CHECKS = {"choice": _check_choice, "score": _check_score, "noul": _check_noul}


class Question(StrictModel):
    type: QuestionType
    instructions: JsonValue = None  # a string, any JSON value, or null
    criteria: Annotated[JsonValue, WithJsonSchema(_CRITERIA_SCHEMA)] = Field(
        default=None, validate_default=True
    )
    gate: Gate | None = None  # Prism extension: per-question AutoThink gate override

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in QUESTION_TYPES:
            raise schema_error(
                "unknown_question_type",
                f"unknown question type {value[:64]!r}; expected noul, choice or score",
            )
        return value

    @field_validator("instructions")
    @classmethod
    def _instructions_size(cls, value: JsonValue, info: ValidationInfo) -> JsonValue:
        if value is None:
            return value
        limit = limits_from(info).max_instruction_chars
        n = json_chars(value)
        if n > limit:
            raise schema_error(
                "instructions_too_long", f"instructions have {n} characters, more than the limit {limit}"
            )
        return value

    @field_validator("criteria")
    @classmethod
    def _criteria_for_type(cls, value: JsonValue, info: ValidationInfo) -> JsonValue:
        qtype = info.data.get("type")
        if qtype in _CRITERIA_CHECKS:  # an invalid type was already reported on its own field
            _CRITERIA_CHECKS[qtype](value, limits_from(info).max_option_chars)
        return value


_DATA_URI = re.compile(r"data:(?P<mime>[a-z0-9][a-z0-9.+-]*/[a-z0-9][a-z0-9.+-]*);base64,", re.IGNORECASE)


def _split_image(s: str) -> str:
    """The base64 payload of an image string (plain base64 or a `data:<mime>;base64,` URI)."""
    if s.startswith("data:"):
        m = _DATA_URI.match(s)
        if m is None:
            raise ValueError("a data URI image must look like data:<mime>;base64,<data>")
        if not m["mime"].lower().startswith("image/"):
            raise ValueError(f"data URI media type {m['mime']!r} is not an image type")
        return s[m.end() :]
    return s


def decoded_image_size(s: str) -> int:
    """Decoded byte count of a (well-formed) base64 image string, without decoding it."""
    b64 = _split_image(s)
    return len(b64) // 4 * 3 - b64[-2:].count("=")


def decode_image(s: str) -> bytes:
    """Decode an image given as base64 or a `data:<mime>;base64,` URI; ValueError names the problem.

    Only the transport encoding is checked here; whether the bytes are a real image is the engine's job.
    """
    b64 = _split_image(s)
    if not b64:
        raise ValueError("image data is empty")
    if len(b64) % 4:
        raise ValueError(f"image base64 length {len(b64)} is not a multiple of 4")
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image is not valid base64: {e}") from e


def _check_image(value: str, info: ValidationInfo) -> str:
    limit = limits_from(info).max_image_bytes
    try:
        if decoded_image_size(value) > limit:  # cheap bound before decoding a huge string
            raise ValueError(
                f"image decodes to {decoded_image_size(value)} bytes, more than the limit {limit}"
            )
        decode_image(value)
    except ValueError as e:
        raise schema_error("invalid_image", str(e)) from e
    return value


ImageData = Annotated[
    str,
    AfterValidator(_check_image),
    WithJsonSchema({"type": "string", "description": "base64, or a data:<mime>;base64, URI"}),
]


class SystemOneRequest(StrictModel):
    model: Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    state: JsonValue = Field(
        description="the evidence: a string, or any JSON value (rendered as compact JSON)"
    )
    questions: dict[QuestionId, Question] = Field(
        description="question id -> question; 1..max_questions (default 64)"
    )
    images: list[ImageData] | None = Field(default=None, description="at most max_images (default 8)")

    @field_validator("state")
    @classmethod
    def _state_size(cls, value: JsonValue, info: ValidationInfo) -> JsonValue:
        limit = limits_from(info).max_state_chars
        n = json_chars(value)
        if n > limit:
            raise schema_error("oversized_state", f"state has {n} characters, more than the limit {limit}")
        return value

    @field_validator("questions", mode="before")
    @classmethod
    def _question_count(cls, value: Any, info: ValidationInfo) -> Any:
        # Checked before the questions themselves so a huge map is refused without validating each entry.
        if isinstance(value, dict):
            limit = limits_from(info).max_questions
            if len(value) > limit:
                raise schema_error(
                    "too_many_questions", f"{len(value)} questions, more than the limit {limit}"
                )
            if not value:
                raise schema_error("no_questions", "a request needs at least one question")
        return value

    @field_validator("images", mode="before")
    @classmethod
    def _image_count(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list):
            limit = limits_from(info).max_images
            if len(value) > limit:
                raise schema_error("too_many_images", f"{len(value)} images, more than the limit {limit}")
        return value


# ---- answers ---------------------------------------------------------------------------------------


def check_distribution(probabilities: list[float] | tuple[float, ...], what: str = "probabilities") -> None:
    """Raise a pydantic error unless the values sum to 1 within PROBABILITY_SUM_TOLERANCE."""
    total = math.fsum(probabilities)
    if abs(total - 1.0) > PROBABILITY_SUM_TOLERANCE:
        raise schema_error(
            "probabilities_sum", f"{what} sum to {total!r}, not 1 (tolerance {PROBABILITY_SUM_TOLERANCE})"
        )


class NoulAnswer(StrictModel):
    type: Literal["noul"]
    noul: Probability  # P(yes); no confidence field on purpose (the wire contract has none)


class ChoiceAnswer(StrictModel):
    type: Literal["choice"]
    choice: str
    confidence: Probability
    probabilities: dict[str, Probability]  # option id -> probability, in display order

    @model_validator(mode="after")
    def _consistent(self) -> ChoiceAnswer:
        if len(self.probabilities) < MIN_CHOICE_OPTIONS:
            raise schema_error("too_few_options", "a choice answer needs at least 2 probabilities")
        if self.choice not in self.probabilities:
            raise schema_error("choice_unknown", f"choice {self.choice!r} is not one of the options")
        check_distribution(list(self.probabilities.values()))
        return self


class ScoreAnswer(StrictModel):
    type: Literal["score"]
    score: float  # sum of i * p_i
    confidence: Probability
    legend: dict[str, str]  # "0".."n-1" -> level description
    probabilities: dict[str, Probability]  # keyed "0".."n-1"

    @model_validator(mode="after")
    def _consistent(self) -> ScoreAnswer:
        n = len(self.probabilities)
        keys = [str(i) for i in range(n)]
        if list(self.probabilities) != keys:
            raise schema_error("score_keys", 'score probabilities must be keyed "0".."n-1" in order')
        if list(self.legend) != keys:
            raise schema_error("score_keys", 'score legend must be keyed "0".."n-1" like the probabilities')
        if not MIN_SCORE_LEVELS <= n <= MAX_SCORE_LEVELS:
            raise _count_error("score", "levels", n, MIN_SCORE_LEVELS, MAX_SCORE_LEVELS)
        check_distribution(list(self.probabilities.values()))
        hi = (n - 1) * (1 + PROBABILITY_SUM_TOLERANCE)
        if not 0.0 <= self.score <= hi:
            raise schema_error("score_range", f"score {self.score!r} is outside 0..{n - 1}")
        return self


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class Usage(StrictModel):
    input_tokens: Annotated[int, Field(ge=0)]
    output_tokens: Annotated[int, Field(ge=0)]


class SystemOneResponse(StrictModel):
    model: str
    answers: dict[QuestionId, Answer]
    usage: Usage
