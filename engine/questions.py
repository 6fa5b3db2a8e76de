"""A question's progress through one `decide` call, and the records built from it.

`QuestionRun` is what the stages (`engine.engine`) and the thought loop (`engine.thoughts`) share:
the rendered prompt's memo, the read-out rounds, the first and second read-outs and the thought.
The functions below turn finished runs into the wire contract's pieces (`schemas.record`) and a
`DecideResult`; they are pure, so a record is a function of the runs and the decision config.

May import: `engine.decide`, `engine.types`, `schemas` (no execution).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.decide.answers import answer_for
from engine.decide.decision_config import DecisionConfig
from engine.decide.readout import ChoiceRounds, LetterReadout, mix_probabilities
from engine.model.prompt import MAX_LETTERS
from engine.types import DecideRequest, DecideResult
from schemas.record import QuestionTrace, Readout, RoundReadout
from schemas.systemone import Answer, Question

LETTERS = [chr(ord("A") + i) for i in range(MAX_LETTERS)]


@dataclass
class QuestionRun:
    """One question's progress through the stages of a decide call."""

    qid: str
    question: Question
    gate: float
    seed: int
    event_id: str
    state_text: str
    rounds: ChoiceRounds
    budget: int
    evidence_digest: str = ""  # the exact prefix this question hangs from (part of its thought key)
    first: Readout | None = None
    prompt_tokens: int = 0  # tokens of every read-out prompt, as if each ran on its own
    # AutoThink
    thinking: bool = False
    thought_ids: list[int] = field(default_factory=list)
    thought_truncated: bool = False
    thought_key: bytes | None = None  # memo of Stages._thought_key
    second: Readout | None = None
    token_memo: dict[tuple[tuple[int, ...], bool], list[int]] = field(default_factory=dict)
    source: DecideRequest | None = None  # its request: deadline and cancellation polled per step
    cut: str | None = None  # why a deadline or cancellation stopped its thought

    @property
    def option_ids(self) -> list[str]:
        return option_ids(self.question)


def option_ids(question: Question) -> list[str]:
    """The ids a question's probabilities are listed under, in the order its letters show them."""
    if question.type == "noul":
        return ["yes", "no"]
    if question.type == "score":
        return [str(i) for i in range(len(question.criteria))]  # type: ignore[arg-type]
    return list(question.criteria)  # type: ignore[arg-type]


def n_options(question: Question) -> int:
    if question.type == "noul":
        return 2
    return len(question.criteria)  # type: ignore[arg-type]


def first_group(question: Question) -> list[str] | None:
    """The options of a choice's first round when it has more than 26 (rounds), else None."""
    if question.type != "choice":
        return None
    ids = list(question.criteria)  # type: ignore[arg-type]
    return ids[: min(len(ids), 25)] if len(ids) > 26 else None


def should_think(q: QuestionRun) -> bool:
    """The AutoThink gate: think when the first read-out's top probability is below the gate.

    The boundary is inclusive for the answer: top == gate stands. Gate 0 never thinks, gate 1
    always does. Choice questions answered in rounds (more than 26 options) do not think: their
    second read-out would need the rounds again.
    """
    assert q.first is not None
    if q.gate <= 0.0 or len(q.option_ids) > MAX_LETTERS:
        return False
    return q.gate >= 1.0 or max(q.first.probabilities) < q.gate


def unit(x: float) -> float:
    return min(1.0, max(0.0, float(x)))


def _coverage(ro: LetterReadout) -> float:
    return unit(ro.coverage if ro.coverage is not None else 1.0)


def readout_record(options: list[str], rounds: ChoiceRounds, temperature: float) -> Readout:
    """The record of a read-out: every round's letters and logits, the final probabilities."""
    round_records = []
    for stage in rounds.stages:
        for group, ro in zip(stage.groups, stage.readouts, strict=True):
            round_records.append(
                RoundReadout(
                    options=[options[i] for i in group],
                    letters=LETTERS[: len(group)],
                    logits=list(ro.logits),
                    coverage=_coverage(ro),
                )
            )
    final = rounds.stages[-1].readouts[0]
    return Readout(
        options=options,
        probabilities=rounds.probabilities,
        coverage=_coverage(final),
        temperature=temperature,
        rounds=round_records,
    )


def single_readout(options: list[str], ro: LetterReadout, temperature: float) -> Readout:
    """The record of one read of at most 26 letters (a second read-out, a read after a thought)."""
    rounds = ChoiceRounds(len(options))
    rounds.submit([ro])
    return readout_record(options, rounds, temperature)


def result(
    req: DecideRequest,
    qs: list[QuestionRun],
    elapsed: float,
    dc: DecisionConfig,
    thought_text: Callable[[list[int]], str],
) -> DecideResult:
    """A request's result from its finished questions; `thought_text` decodes thought tokens."""
    answers: dict[str, Answer] = {}
    traces: dict[str, QuestionTrace] = {}
    input_tokens = 0
    output_tokens = 0
    stopped = next((q.cut for q in qs if q.cut is not None), None)
    for q in qs:
        assert q.first is not None
        final = list(q.first.probabilities)
        if q.second is not None:
            final = list(mix_probabilities(q.first.probabilities, q.second.probabilities, dc.second_weight))
        answers[q.qid] = answer_for(q.question, final, confidence=dc.confidence)
        input_tokens += q.prompt_tokens
        output_tokens += len(q.thought_ids)
        traces[q.qid] = QuestionTrace(
            prompt_tokens=q.prompt_tokens,
            first=q.first,
            second=q.second,
            thought=thought_text(q.thought_ids) if q.thinking else None,
            thought_tokens=len(q.thought_ids),
            thought_truncated=q.thought_truncated,
            final_probabilities=final,
        )
    return DecideResult(
        request_id=req.request_id,
        answers=answers,
        traces=traces,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        timings={"decide_s": elapsed},
        stopped=stopped,  # type: ignore[arg-type]
        thought_ids={q.qid: list(q.thought_ids) for q in qs if q.thinking},
    )


def stopped_result(req: DecideRequest, reason: str) -> DecideResult:
    return DecideResult(req.request_id, {}, {}, 0, 0, stopped=reason)  # type: ignore[arg-type]


def rejected_result(req: DecideRequest, reason: str) -> DecideResult:
    return DecideResult(
        request_id=req.request_id, answers={}, traces={}, input_tokens=0, output_tokens=0, error=reason
    )
