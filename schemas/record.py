"""The decision record published for every evidence event.

A record's value is a pure function of (event, model digest, precision path, decision config, seed):
nothing run-dependent (timings, worker ids, attempts) belongs here; that travels in Kafka headers. So a
redelivered or replayed event yields a byte-identical value (see `schemas.codec.dumps`) under the same
key (`record_key`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.event import EventId, Seed, Source, Tenant, Timestamp
from schemas.systemone import (
    Answer,
    Probability,
    QuestionId,
    StrictModel,
    Usage,
    check_distribution,
    schema_error,
)

Precision = Literal["int8", "bf16", "fp32"]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="lower-case sha256 hex digest")]
NonEmpty = Annotated[str, Field(min_length=1)]
Letter = Annotated[str, Field(pattern=r"^[A-Z]$")]
Count = Annotated[int, Field(ge=0)]


def _unique(values: list[str], what: str) -> None:
    if len(set(values)) != len(values):
        raise schema_error("duplicate_entries", f"{what} must be unique")


class Provenance(StrictModel):
    name: NonEmpty
    file_digest: Sha256Hex  # of the GGUF file
    engine_version: NonEmpty
    precision: Precision
    render_version: NonEmpty  # prompt renderer, e.g. "jev_render_v3"
    decision_config_digest: Sha256Hex  # of the decision-affecting config (temperatures, mixing, gate...)
    gate: Probability  # the serving default; the event may override it (event.gate, question.gate)
    thought_budget: Annotated[int, Field(ge=0)]  # 0: the model does not think
    mix_weight: Probability  # weight of the second read-out when AutoThink ran


class RoundReadout(StrictModel):
    """One prompt's raw read-out: the letters shown and their logits (before temperature)."""

    options: list[str]  # option ids in display order
    letters: list[Letter]
    logits: list[float]
    coverage: Probability  # probability mass the full vocabulary put outside these letters

    @model_validator(mode="after")
    def _aligned(self) -> RoundReadout:
        if not len(self.options) == len(self.letters) == len(self.logits) >= 1:
            raise schema_error(
                "readout_shape", "options, letters and logits must have the same non-zero length"
            )
        _unique(self.options, "round options")
        _unique(self.letters, "round letters")
        return self


class Readout(StrictModel):
    """A read-out over all options (one round, or several for >26 options)."""

    options: list[str]  # option ids in display order
    probabilities: list[Probability]  # aligned with options
    coverage: Probability
    temperature: Annotated[float, Field(gt=0.0)]
    rounds: list[RoundReadout]

    @model_validator(mode="after")
    def _aligned(self) -> Readout:
        if len(self.options) != len(self.probabilities) or not self.options:
            raise schema_error(
                "readout_shape", "options and probabilities must have the same non-zero length"
            )
        _unique(self.options, "readout options")
        check_distribution(self.probabilities)
        if not self.rounds:
            raise schema_error("readout_shape", "a read-out has at least one round")
        return self


class QuestionTrace(StrictModel):
    prompt_tokens: Count
    first: Readout
    second: Readout | None = None  # present when AutoThink thought and re-read the letters
    thought: str | None = None
    thought_tokens: Count = 0
    thought_truncated: bool = False  # the budget ran out before </think>
    final_probabilities: list[Probability]  # aligned with first.options

    @model_validator(mode="after")
    def _consistent(self) -> QuestionTrace:
        if len(self.final_probabilities) != len(self.first.options):
            raise schema_error("readout_shape", "final_probabilities must align with first.options")
        if self.second is not None and self.second.options != self.first.options:
            raise schema_error("readout_shape", "second.options must equal first.options")
        check_distribution(self.final_probabilities, "final_probabilities")
        return self


class InputRef(StrictModel):
    topic: NonEmpty
    partition: Count
    offset: Count


class DecisionRecord(StrictModel):
    record_version: Literal[1]
    event_id: EventId
    source: Source
    tenant: Tenant
    created_at: Timestamp
    model: Provenance
    seed: Seed
    answers: dict[QuestionId, Answer]
    questions: dict[QuestionId, QuestionTrace]
    usage: Usage
    input: InputRef | None = None

    @field_validator("record_version", mode="before")
    @classmethod
    def _not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # True == 1 would slip through the Literal
            raise schema_error("literal_error", "record_version must be 1")
        return value

    @model_validator(mode="after")
    def _same_questions(self) -> DecisionRecord:
        if list(self.answers) != list(self.questions):
            raise schema_error(
                "question_mismatch", "answers and questions must have the same ids in the same order"
            )
        return self


def record_key(event_id: str) -> bytes:
    """Kafka key of an event's decision record (deterministic: the event id's UTF-8 bytes)."""
    return event_id.encode("utf-8")
