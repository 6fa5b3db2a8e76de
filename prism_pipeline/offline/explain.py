"""A human-readable account of one decision: prompt, thought and read-outs (`prism replay --explain`).

Everything shown comes from the event (the prompt is re-rendered with `engine.model.prompt`, the same
renderer the engine uses) and the decision record (read-outs, thought, answers), so the account is
exactly what the record says, not a paraphrase. Pure functions: the CLI prints the returned text.
"""

from __future__ import annotations

from engine.model.prompt import SYSTEM_PROMPT, render_parts
from schemas.event import EvidenceEvent
from schemas.record import DecisionRecord, QuestionTrace, Readout
from schemas.systemone import Question

_EMPTY_THINK = "<think>\n\n</think>\n\n"


def chat_text(state: object, question: Question, option_ids: list[str] | None = None, *, think: bool) -> str:
    """The full ChatML prompt text of one read-out (special tokens written out)."""
    parts = render_parts(state, question, option_ids)
    opener = "<think>\n" if think else _EMPTY_THINK
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"<|im_start|>user\n{parts.user}<|im_end|>\n"
        f"<|im_start|>assistant\n{opener}"
    )


def _indent(text: str, pad: str = "    │ ") -> str:
    return "\n".join(pad + line for line in text.split("\n"))


def _answer_line(record: DecisionRecord, qid: str) -> str:
    a = record.answers[qid]
    if a.type == "noul":
        return f"P(yes) = {a.noul!r}"
    if a.type == "choice":
        return f"{a.choice!r} (confidence {a.confidence!r})"
    return f"score {a.score!r} (confidence {a.confidence!r})"


def _readout_lines(name: str, r: Readout) -> list[str]:
    lines = [f"  {name} read-out: temperature {r.temperature!r}, mass outside the letters {r.coverage!r}"]
    probs = dict(zip(r.options, r.probabilities, strict=True))
    for i, rnd in enumerate(r.rounds):
        if len(r.rounds) > 1:
            lines.append(f"    round {i + 1} (mass outside its letters {rnd.coverage!r})")
        lines.append(f"    {'letter':<7}{'option':<20}{'logit':>22}  {'probability':>22}")
        for letter, opt, logit in zip(rnd.letters, rnd.options, rnd.logits, strict=True):
            lines.append(f"    {letter:<7}{opt[:19]:<20}{logit!r:>22}  {probs.get(opt, float('nan'))!r:>22}")
    return lines


def explain_question(event: EvidenceEvent, record: DecisionRecord, qid: str) -> str:
    question = event.request.questions[qid]
    trace: QuestionTrace = record.questions[qid]
    gate = next(g for g in (question.gate, event.gate, record.model.gate) if g is not None)
    lines = [f"question {qid!r} ({question.type}), gate {gate!r}: {_answer_line(record, qid)}"]
    rounds = trace.first.rounds
    for i, rnd in enumerate(rounds):
        ids = rnd.options if question.type == "choice" and len(rounds) > 1 else None
        head = "prompt" if len(rounds) == 1 else f"prompt, round {i + 1}"
        lines.append(f"  {head} ({trace.prompt_tokens} prompt tokens over all read-outs):")
        lines.append(_indent(chat_text(event.request.state, question, ids, think=False)))
    lines += _readout_lines("first", trace.first)
    if trace.second is not None:
        status = "cut at the budget" if trace.thought_truncated else "closed by </think>"
        lines.append(f"  thought ({trace.thought_tokens} tokens, {status}):")
        lines.append(_indent(trace.thought or "", "    ┊ "))
        lines += _readout_lines("second", trace.second)
        lines.append(f"  mixing weight of the second read-out: {record.model.mix_weight!r}")
    else:
        lines.append("  no thought (first read-out at or above the gate)")
    finals = ", ".join(
        f"{o}={p!r}" for o, p in zip(trace.first.options, trace.final_probabilities, strict=True)
    )
    lines.append(f"  final probabilities: {finals}")
    return "\n".join(lines)


def explain(event: EvidenceEvent, record: DecisionRecord, verdict: str | None = None) -> str:
    """The whole decision for `event` as text; `verdict` (e.g. the replay comparison) heads it."""
    m = record.model
    where = f"{record.input.topic}/{record.input.partition}@{record.input.offset}" if record.input else "-"
    out = [
        f"event {record.event_id} ({record.source}, tenant {record.tenant}, created "
        f"{record.created_at.isoformat()}), seed {record.seed}, input {where}",
        f"model {m.name} (file sha256 {m.file_digest}), {m.precision}, engine {m.engine_version}, "
        f"{m.render_version}, decision config {m.decision_config_digest[:16]}…",
        f"usage: {record.usage.input_tokens} input tokens, {record.usage.output_tokens} thought tokens",
    ]
    if verdict:
        out.append(verdict)
    for qid in record.questions:
        out.append("")
        out.append(explain_question(event, record, qid))
    return "\n".join(out) + "\n"
