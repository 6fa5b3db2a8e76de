"""Model-level rules: limits through the validation context, answers, records, images, dead letters."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from schema_strategies import record_dicts

from schemas import (
    ChoiceAnswer,
    DecisionRecord,
    EvidenceEvent,
    InvalidEvent,
    Limits,
    NoulAnswer,
    Question,
    ReasonCode,
    ScoreAnswer,
    SystemOneRequest,
    SystemOneResponse,
    decode_image,
    dumps,
    parse_event,
    record_key,
    validation_context,
)


def _error(exc: pytest.ExceptionInfo[ValidationError]) -> tuple[str, tuple]:
    e = exc.value.errors()[0]
    return e["type"], e["loc"]


# ---- limits ----------------------------------------------------------------------------------------


def test_limits_come_from_the_validation_context() -> None:
    data = {"state": "abcdef", "questions": {"q": {"type": "noul", "instructions": "x" * 20}}}
    assert SystemOneRequest.model_validate(data).state == "abcdef"  # defaults when no context
    with pytest.raises(ValidationError) as exc:
        SystemOneRequest.model_validate(data, context=validation_context(Limits(max_state_chars=5)))
    assert _error(exc) == ("oversized_state", ("state",))
    with pytest.raises(ValidationError) as exc:
        SystemOneRequest.model_validate(data, context=validation_context(Limits(max_instruction_chars=19)))
    assert _error(exc) == ("instructions_too_long", ("questions", "q", "instructions"))
    long_option = {"type": "choice", "criteria": {"a": "x" * 11, "b": None}}
    with pytest.raises(ValidationError) as exc:
        Question.model_validate(long_option, context={"limits": Limits(max_option_chars=10)})
    assert _error(exc) == ("option_too_long", ("criteria",))


def test_limits_reject_nonsense() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_questions"):
            Limits(max_questions=bad)


def test_state_integer_beyond_64_bits_is_refused_with_a_message() -> None:
    with pytest.raises(ValidationError, match="cannot be rendered as JSON"):
        SystemOneRequest(state={"n": 2**64}, questions={"q": Question(type="noul")})


def test_strict_types_no_coercion() -> None:
    with pytest.raises(ValidationError):
        Question(type="noul", gate="0.5")
    with pytest.raises(ValidationError):
        EvidenceEvent.model_validate(
            {"event_id": "e", "source": "alert", "tenant": "t", "created_at": 1700000000, "request": {}}
        )


def test_question_criteria_shapes() -> None:
    assert Question(type="noul").criteria is None
    assert Question(type="noul", criteria={"true": "it is"}).criteria == {"true": "it is"}
    assert Question(type="score", criteria=["a", "b"]).criteria == ["a", "b"]
    with pytest.raises(ValidationError, match="list of levels"):
        Question(type="score", criteria={"a": None, "b": None})
    with pytest.raises(ValidationError, match="must be a string"):
        Question(type="score", criteria=["a", None])
    with pytest.raises(ValidationError, match="object"):
        Question(type="choice", criteria=["a", "b"])
    with pytest.raises(ValidationError) as exc:
        Question(type="score", criteria=["low", " "])
    assert _error(exc) == ("empty_option_name", ("criteria",))


# ---- images ----------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    st.binary(min_size=1, max_size=300),
    st.sampled_from(["", "data:image/png;base64,", "data:Image/JPEG;base64,"]),
)
def test_decode_image_inverts_base64(data: bytes, prefix: str) -> None:
    assert decode_image(prefix + base64.b64encode(data).decode()) == data


def test_decode_image_rejects() -> None:
    for bad, why in [
        ("", "empty"),
        ("QUJ", "multiple of 4"),
        ("QU=D", "base64"),
        ("QUJD\n", "multiple of 4"),
        ("-_-_", "base64"),  # URL-safe alphabet is not accepted
        ("data:image/png;base64", "data:<mime>"),
        ("data:text/plain;base64,QUJD", "not an image"),
    ]:
        with pytest.raises(ValueError, match=why):
            decode_image(bad)


# ---- answers ---------------------------------------------------------------------------------------


def test_answers_validate_consistency() -> None:
    ok = ChoiceAnswer(type="choice", choice="a", confidence=0.2, probabilities={"a": 0.6, "b": 0.4})
    assert ok.choice == "a"
    with pytest.raises(ValidationError, match="not one of the options"):
        ChoiceAnswer(type="choice", choice="c", confidence=0.2, probabilities={"a": 0.6, "b": 0.4})
    with pytest.raises(ValidationError, match="sum to"):
        ChoiceAnswer(type="choice", choice="a", confidence=0.2, probabilities={"a": 0.6, "b": 0.3})
    with pytest.raises(ValidationError):
        NoulAnswer(type="noul", noul=1.2)
    legend = {"0": "low", "1": "mid", "2": "high"}
    probs = {"0": 0.2, "1": 0.3, "2": 0.5}
    s = ScoreAnswer(type="score", score=1.3, confidence=0.1, legend=legend, probabilities=probs)
    assert s.score == 1.3
    with pytest.raises(ValidationError, match="keyed"):
        ScoreAnswer(
            type="score", score=1.3, confidence=0.1, legend=legend, probabilities={"1": 0.5, "0": 0.5, "2": 0}
        )
    with pytest.raises(ValidationError, match="outside"):
        ScoreAnswer(type="score", score=2.5, confidence=0.1, legend=legend, probabilities=probs)


def test_response_discriminates_answers_by_type() -> None:
    resp = SystemOneResponse.model_validate(
        {
            "model": "startlux-decision-4b",
            "answers": {
                "u": {"type": "noul", "noul": 0.75},
                "t": {
                    "type": "choice",
                    "choice": "b",
                    "confidence": 0.5,
                    "probabilities": {"a": 0.25, "b": 0.75},
                },
            },
            "usage": {"input_tokens": 120, "output_tokens": 0},
        }
    )
    assert isinstance(resp.answers["u"], NoulAnswer) and isinstance(resp.answers["t"], ChoiceAnswer)
    with pytest.raises(ValidationError):  # noul answers have no confidence field
        NoulAnswer.model_validate({"type": "noul", "noul": 0.5, "confidence": 0.0})


# ---- records ---------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(record_dicts(), st.data())
def test_record_rejects_inconsistent_traces(rec: dict, data: st.DataObject) -> None:
    qid = data.draw(st.sampled_from(sorted(rec["questions"])))
    broken = data.draw(st.sampled_from(["final_len", "answer_missing", "letters", "digest", "version"]))
    if broken == "final_len":
        rec["questions"][qid]["final_probabilities"].append(0.0)
    elif broken == "answer_missing":
        del rec["answers"][qid]
    elif broken == "letters":
        rec["questions"][qid]["first"]["rounds"][0]["letters"][0] = "a"
    elif broken == "digest":
        rec["model"]["file_digest"] = rec["model"]["file_digest"].upper()
    else:
        rec["record_version"] = True
    with pytest.raises(ValidationError):
        DecisionRecord.model_validate(rec)


def test_record_key_is_the_event_id_bytes() -> None:
    assert record_key("évènement-1") == "évènement-1".encode()
    assert record_key("a") != record_key("b")


def test_records_from_equal_content_are_byte_identical() -> None:
    # Determinism of the value: the same content built twice (and through JSON) encodes identically.
    created = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
    trace = {
        "prompt_tokens": 90,
        "first": {
            "options": ["yes", "no"],
            "probabilities": [0.7, 0.3],
            "coverage": 0.01,
            "temperature": 1.0,
            "rounds": [
                {"options": ["yes", "no"], "letters": ["A", "B"], "logits": [3.5, 2.65], "coverage": 0.01}
            ],
        },
        "final_probabilities": [0.7, 0.3],
    }
    fields = {
        "record_version": 1,
        "event_id": "e1",
        "source": "alert",
        "tenant": "t",
        "created_at": created,
        "model": {
            "name": "m",
            "file_digest": "0" * 64,
            "engine_version": "0.1.0",
            "precision": "int8",
            "render_version": "jev_render_v3",
            "decision_config_digest": "f" * 64,
            "gate": 0.6,
            "thought_budget": 4096,
            "mix_weight": 1.0,
        },
        "seed": 7,
        "answers": {"u": {"type": "noul", "noul": 0.7}},
        "questions": {"u": trace},
        "usage": {"input_tokens": 90, "output_tokens": 0},
    }
    a = DecisionRecord.model_validate(fields)
    b = DecisionRecord.model_validate(dict(reversed(list(fields.items()))))
    assert dumps(a) == dumps(b)
    assert dumps(a).startswith(b'{"record_version":1,"event_id":"e1"')


# ---- dead letters ----------------------------------------------------------------------------------


def test_invalid_event_to_dead_letter() -> None:
    raw = b'{"event_id": 1}' + b" " * 100
    with pytest.raises(InvalidEvent) as exc:
        parse_event(raw)
    dl = exc.value.to_dead_letter(
        raw, topic="evidence", partition=2, offset=10, key=b"k", max_original_bytes=8
    )
    assert dl.reason is ReasonCode.schema_violation
    assert dl.original_size == len(raw)
    assert base64.b64decode(dl.original_b64) == raw[:8]
    assert ["event_id"] in [e.loc for e in dl.errors]
    assert all(e.msg for e in dl.errors)
