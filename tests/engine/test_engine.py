"""Engine I: `Engine.decide` answers, its read-out properties, AutoThink, and bad model files.

Oracle: a plain full-sequence forward (`engine.run.reference.forward`, what `Engine.logits` runs,
checked against HF in test_gguf_vs_hf and test_reference) over the token ids of each
question's whole prompt, rendered alone (`PromptEncoder.render`, checked token for token
against the chat template in test_prompt).
The letter logits at the last position, softmaxed in float64, are what every read-out of
`decide` must reproduce, so these tests pin the forest execution, the letter -> option
mapping, the rounds bookkeeping and the token accounting together.

All tests use the tiny F32 model (full vocabulary) from the session fixtures.
"""

from __future__ import annotations

import math
import struct
import traceback
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from engine.cache import prefix_key
from engine.decide.decision_config import DecisionConfig, Temperatures
from engine.decide.sampling import sample_token, thought_key, uniform
from engine.engine import Engine
from engine.model.gguf import GGUFError, open_gguf
from engine.model.prompt import render_state
from engine.run.reference import forward
from engine.types import DecideRequest
from schemas.systemone import Answer, Question, SystemOneRequest, SystemOneResponse, Usage

PROB_TOL = 1e-5  # forest read-out vs plain forward, probabilities
LOGIT_TOL = 1e-4  # forest read-out vs plain forward, raw letter logits
SUM_TOL = 1e-6
ANSWER = TypeAdapter(Answer)
# These examples run the model: few of them, and no shrinking (it would re-run the model for
# minutes); a failure is reported with its unshrunk example.
MODEL_SETTINGS = settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


@pytest.fixture(scope="module")
def engine(loaded_engine) -> Engine:
    return loaded_engine("F32", "tiny", 0)


def with_config(base: Engine, config: DecisionConfig) -> Engine:
    """Another engine over the same weights and tokenizer with a different decision config."""
    return Engine(weights=base.weights, tokenizer=base.tokenizer, decision_config=config)


# ------------------------------------------------------------------------------------ oracle
def letter_logits(
    eng: Engine, state, question: Question, option_ids=None, *, think_ids: list[int] | None = None
) -> list[float]:
    """Letter logits after the whole prompt (optionally: think opener + thought + close)."""
    if think_ids is None:
        rp = eng.prompts.render(state, question, option_ids=option_ids)
        ids = rp.token_ids
    else:
        rp = eng.prompts.render(state, question, option_ids=option_ids, think=True)
        ids = rp.token_ids + think_ids + eng.prompts.think_close_ids
    return last_logits(eng, ids)[eng.prompts.letter_token_ids(len(rp.letters))].tolist()


def last_logits(eng: Engine, ids: list[int]) -> torch.Tensor:
    """Next-token logits after `ids` from a plain forward over the whole sequence (the LM head
    only at the last position: `forward(positions=...)` is pinned to slices of the full
    logits in test_reference)."""
    return forward(eng.weights, ids, positions=[len(ids) - 1])[0]


def softmax64(logits: list[float], temperature: float = 1.0) -> list[float]:
    x = torch.tensor(logits, dtype=torch.float64) / temperature
    return torch.softmax(x, 0).tolist()


def prompt_length(eng: Engine, state, question: Question, option_ids=None) -> int:
    return len(eng.prompts.render(state, question, option_ids=option_ids).token_ids)


def answer_probabilities(answer) -> list[float]:
    """Option probabilities in display order (noul: [P(yes), P(no)])."""
    if answer.type == "noul":
        return [answer.noul, 1.0 - answer.noul]
    return list(answer.probabilities.values())


def round_option_ids(question: Question, options: list[str]) -> list[str] | None:
    return options if question.type == "choice" else None


def check_answer_shape(question: Question, answer, final: list[float]) -> None:
    """The answer is valid on the wire and says what the final probabilities say."""
    again = ANSWER.validate_python(answer.model_dump())
    assert again == answer and answer.type == question.type
    assert math.fsum(final) == pytest.approx(1.0, abs=SUM_TOL)
    if question.type == "noul":
        assert answer.noul == pytest.approx(final[0], abs=1e-12)
    elif question.type == "choice":
        ids = list(question.criteria)
        assert list(answer.probabilities) == ids
        assert answer.probabilities[answer.choice] == max(answer.probabilities.values())
        assert answer.choice == ids[max(range(len(final)), key=lambda i: (final[i], -i))]
        n = len(ids)
        assert answer.confidence == pytest.approx((max(final) - 1 / n) / (1 - 1 / n), abs=1e-9)
    else:
        levels = question.criteria
        assert list(answer.probabilities) == [str(i) for i in range(len(levels))]
        assert list(answer.legend.values()) == levels
        assert answer.score == pytest.approx(sum(i * p for i, p in enumerate(final)), abs=1e-9)
    assert answer_probabilities(answer) == pytest.approx(final, abs=1e-12)


def check_against_oracle(eng: Engine, req: DecideRequest, result, temperatures: Temperatures) -> None:
    """Every round read-out of every question equals the plain forward of its own prompt."""
    state = req.request.state
    expected_input = 0
    for qid, q in req.request.questions.items():
        trace = result.traces[qid]
        t = getattr(temperatures, q.type)
        for rnd in trace.first.rounds:
            option_ids = round_option_ids(q, rnd.options)
            ref = letter_logits(eng, state, q, option_ids)
            assert rnd.logits == pytest.approx(ref, abs=LOGIT_TOL), (qid, rnd.options)
            expected_input += prompt_length(eng, state, q, option_ids)
        if len(trace.first.rounds) == 1:
            ref_p = softmax64(trace.first.rounds[0].logits, t)
            assert trace.first.probabilities == pytest.approx(ref_p, abs=1e-12)
            ref_plain = softmax64(letter_logits(eng, state, q), t)
            assert trace.first.probabilities == pytest.approx(ref_plain, abs=PROB_TOL)
    assert result.input_tokens == expected_input


# ----------------------------------------------------------------------------- answers / usage
FIXED_REQUEST = {
    "state": {"ticket": {"id": 42, "body": "Cannot log in ✋ since the update", "tags": list("abcdefgh")}},
    "questions": {
        "urgent": {"type": "noul"},
        "angry": {
            "type": "noul",
            "instructions": "Is the customer upset?",
            "criteria": {"true": "The customer is angry", "false": None},
        },
        "route": {
            "type": "choice",
            "instructions": "Route the ticket.",
            "criteria": {"billing": None, "tech_support": "Tech Support", "sales": "Buying questions"},
        },
        "many": {
            "type": "choice",
            "instructions": "Which product?",
            "criteria": {f"product-{i:02d}": (f"Product number {i}" if i % 3 else None) for i in range(40)},
        },
        "severity": {
            "type": "score",
            "instructions": "Severity?",
            "criteria": ["none", "minor", "major", "critical", "outage"],
        },
        "two": {"type": "score", "criteria": ["low", "high"]},
    },
}


def test_decide_gives_valid_systemone_answers_equal_to_plain_forward(engine: Engine) -> None:
    request = SystemOneRequest.model_validate(FIXED_REQUEST)
    req = DecideRequest("evt-1", request, seed=7, gate=0.0)
    (result,) = engine.decide([req])
    assert result.request_id == "evt-1" and set(result.answers) == set(request.questions)
    assert result.output_tokens == 0
    for qid, q in request.questions.items():
        trace = result.traces[qid]
        assert trace.second is None and trace.thought is None  # gate 0: nobody thinks
        check_answer_shape(q, result.answers[qid], trace.final_probabilities)
    check_against_oracle(engine, req, result, engine.decision_config.temperatures)

    response = SystemOneResponse(
        model=engine.model_name,
        answers=result.answers,
        usage=Usage(input_tokens=result.input_tokens, output_tokens=result.output_tokens),
    )
    assert SystemOneResponse.model_validate_json(response.model_dump_json()) == response


def test_forty_options_run_in_rounds_with_every_option_positive(engine: Engine) -> None:
    request = SystemOneRequest.model_validate(
        {"state": FIXED_REQUEST["state"], "questions": {"many": FIXED_REQUEST["questions"]["many"]}}
    )
    (result,) = engine.decide([DecideRequest("evt-2", request, gate=0.0)])
    trace = result.traces["many"]
    ids = list(request.questions["many"].criteria)
    rounds = trace.first.rounds
    *groups, final = rounds
    # first-round groups: contiguous, in display order, covering every option once, <= 25 each
    assert sum((g.options for g in groups), []) == ids and all(len(g.options) <= 25 for g in groups)
    # finalists: each group's top 3 by its own read-out, kept in display order
    finalists = []
    for g in groups:
        top = sorted(range(len(g.options)), key=lambda i: (-g.logits[i], i))[:3]
        finalists += [g.options[i] for i in sorted(top)]
    assert final.options == finalists
    p = trace.final_probabilities
    assert all(x > 0.0 for x in p) and math.fsum(p) == pytest.approx(1.0, abs=SUM_TOL)
    best_final = final.options[max(range(len(final.logits)), key=lambda i: (final.logits[i], -i))]
    assert result.answers["many"].choice == best_final


# ------------------------------------------------------------------------------- strategies
_chars = st.characters(codec="utf-8", exclude_categories=("Cs", "Cn", "Co"))
_text = st.text(_chars, max_size=30)
_name = st.text(_chars, min_size=1, max_size=12).filter(lambda s: s.strip() != "")
_desc = st.none() | _text
_state = st.one_of(
    _text,
    st.dictionaries(_name, st.integers(-1000, 1000) | _text | st.none(), max_size=4),
    st.lists(st.integers(0, 99), max_size=10),
)


def _choice(n_min: int, n_max: int) -> st.SearchStrategy[dict]:
    return st.builds(
        lambda ins, crit: {"type": "choice", "instructions": ins, "criteria": crit},
        st.none() | _text,
        st.dictionaries(_name, _desc, min_size=n_min, max_size=n_max),
    )


_noul = st.builds(
    lambda ins, t, f: {"type": "noul", "instructions": ins, "criteria": {"true": t, "false": f}},
    st.none() | _text,
    _desc,
    _desc,
) | st.just({"type": "noul"})
_score = st.builds(
    lambda ins, lv: {"type": "score", "instructions": ins, "criteria": lv},
    st.none() | _text,
    st.lists(_name, min_size=2, max_size=10),
)
_question = st.one_of(_noul, _score, _choice(2, 8), _choice(27, 32))


@st.composite
def requests(draw, max_questions: int = 3) -> SystemOneRequest:
    qs = draw(st.lists(_question, min_size=1, max_size=max_questions))
    # at most one >26-option choice per request keeps each example to a few forests
    big = [i for i, q in enumerate(qs) if q["type"] == "choice" and len(q["criteria"]) > 26]
    qs = [q for i, q in enumerate(qs) if i not in big[1:]]
    return SystemOneRequest.model_validate(
        {"state": draw(_state), "questions": {f"q{i}": q for i, q in enumerate(qs)}}
    )


# ------------------------------------------------------------------------------- properties
@MODEL_SETTINGS
@given(request=requests())
def test_probabilities_sum_to_one(engine: Engine, request: SystemOneRequest) -> None:
    (result,) = engine.decide([DecideRequest("evt", request, gate=0.0)])
    for qid, q in request.questions.items():
        final = result.traces[qid].final_probabilities
        assert math.fsum(final) == pytest.approx(1.0, abs=SUM_TOL), qid
        assert all(0.0 <= p <= 1.0 for p in final)
        check_answer_shape(q, result.answers[qid], final)


_temperature = st.floats(0.05, 20.0, allow_nan=False)


@MODEL_SETTINGS
@given(request=requests(), t=st.tuples(_temperature, _temperature, _temperature))
def test_temperature_never_changes_the_argmax(engine: Engine, request: SystemOneRequest, t) -> None:
    temps = Temperatures(noul=t[0], choice=t[1], score=t[2])
    hot = with_config(engine, DecisionConfig(temperatures=temps))
    (base,) = engine.decide([DecideRequest("evt", request, gate=0.0)])
    (other,) = hot.decide([DecideRequest("evt", request, gate=0.0)])
    for qid, q in request.questions.items():
        p1 = base.traces[qid].final_probabilities
        pt = other.traces[qid].final_probabilities
        argmax = max(range(len(p1)), key=lambda i: (p1[i], -i))
        assert max(range(len(pt)), key=lambda i: (pt[i], -i)) == argmax, qid
        if q.type == "choice":
            assert other.answers[qid].choice == base.answers[qid].choice
        first_t = other.traces[qid].first
        # temperature touches the read-out only: same raw logits, probabilities softmax(l / T)
        assert [r.logits for r in first_t.rounds] == [r.logits for r in base.traces[qid].first.rounds]
        assert first_t.temperature == getattr(temps, q.type)
        if len(first_t.rounds) == 1:
            ref = softmax64(first_t.rounds[0].logits, getattr(temps, q.type))
            assert first_t.probabilities == pytest.approx(ref, abs=1e-12)


@MODEL_SETTINGS
@given(
    n=st.integers(2, 8),
    described=st.booleans(),
    data=st.data(),
)
def test_option_permutation_maps_letters_to_options_consistently(
    engine: Engine, n: int, described: bool, data
) -> None:
    """Permuting the criteria order is a different prompt, so probabilities may change; what
    must hold is that letter i of the permuted prompt's read-out is reported for option
    permuted[i], for the original order and for the permutation alike."""
    ids = [f"opt{i}" for i in range(n)]
    perm = data.draw(st.permutations(ids))
    crit = {i: (f"meaning of {i}" if described else None) for i in ids}
    state = data.draw(_text)
    for order in (ids, perm):
        q = Question.model_validate(
            {"type": "choice", "instructions": "Pick one.", "criteria": {i: crit[i] for i in order}}
        )
        request = SystemOneRequest(state=state, questions={"q": q})
        (result,) = engine.decide([DecideRequest("evt", request, gate=0.0)])
        rendered = engine.prompts.render(state, q)
        # the prompt lists the options in `order`: line i is letter i followed by option order[i]
        lines = rendered.user.split("\nOptions:\n", 1)[1].split("\n")
        assert [ln.split(") ", 1) for ln in lines] == [
            [chr(65 + i), f"{o}: meaning of {o}" if described else o] for i, o in enumerate(order)
        ]
        ref = softmax64(letter_logits(engine, state, q))
        got = result.answers["q"].probabilities
        assert list(got) == list(order)
        for i, option in enumerate(order):
            assert got[option] == pytest.approx(ref[i], abs=PROB_TOL), (option, order)


# -------------------------------------------------------------------------------- AutoThink
def reference_thought(eng: Engine, req: DecideRequest, qid: str, q: Question, budget: int):
    """Thought decoded the slow way: a full forward per step, the same keyed draws."""
    dc = eng.decision_config
    prompt = eng.prompts.render(req.request.state, q, think=True).token_ids
    # the key: what the model sees - the evidence prefix's digest and the question's own tokens
    prefix = eng.prompts.prefix_ids + eng.prompts.evidence_ids(render_state(req.request.state))
    assert prompt[: len(prefix)] == prefix
    key = thought_key(req.seed, prefix_key(prefix), prompt[len(prefix) :])
    thought: list[int] = []
    for step in range(budget):
        logits = last_logits(eng, prompt + thought)
        u = uniform(key, step)
        token = sample_token(
            logits, u, temperature=dc.thought_temperature, top_p=dc.thought_top_p, top_k=dc.thought_top_k
        )
        if token == eng.tokenizer.special.end_think:
            return thought, False
        thought.append(token)
    return thought, True


def test_autothink_gate_budget_and_second_readout(engine: Engine) -> None:
    request = SystemOneRequest.model_validate(
        {
            "state": "Server room temperature 41C, fans at 100%, two disks reporting errors.",
            "questions": {
                "hot": {"type": "noul", "instructions": "Is this an emergency?"},
                "kind": {"type": "choice", "criteria": {"hardware": None, "network": None, "power": None}},
                "sev": {"type": "score", "criteria": ["low", "medium", "high"], "gate": 0.0},
                "many": FIXED_REQUEST["questions"]["many"],
            },
        }
    )
    budget = 3
    req = DecideRequest("evt-think", request, seed=11, gate=1.0, thought_budget=budget)
    (result,) = engine.decide([req])
    thinkers = {"hot", "kind"}  # gate 1 > any top probability; "sev" overrides with 0; >26 never thinks
    assert {qid for qid, t in result.traces.items() if t.second is not None} == thinkers
    total = 0
    for qid, q in request.questions.items():
        trace = result.traces[qid]
        check_answer_shape(q, result.answers[qid], trace.final_probabilities)
        if qid not in thinkers:
            assert trace.thought is None and trace.thought_tokens == 0
            continue
        thought, truncated = reference_thought(engine, req, qid, q, budget)
        assert trace.thought_tokens == len(thought) <= budget
        assert trace.thought == engine.tokenizer.decode(thought)
        assert trace.thought_truncated == truncated
        ref = softmax64(
            letter_logits(engine, request.state, q, think_ids=thought),
            engine.decision_config.temperature(q.type),
        )
        assert trace.second.probabilities == pytest.approx(ref, abs=PROB_TOL)
        # default mixing weight 1.0: the answer is the post-thought read-out
        assert trace.final_probabilities == pytest.approx(trace.second.probabilities, abs=1e-12)
        total += len(thought)
    assert result.output_tokens == total


def test_gate_zero_and_question_gate_override(engine: Engine) -> None:
    request = SystemOneRequest.model_validate(
        {"state": "x", "questions": {"a": {"type": "noul", "gate": 1.0}, "b": {"type": "noul"}}}
    )
    (result,) = engine.decide([DecideRequest("evt", request, gate=0.0, thought_budget=1)])
    assert result.traces["a"].second is not None and result.traces["b"].second is None
    assert (
        result.traces["a"].thought_tokens <= 1 and result.output_tokens == result.traces["a"].thought_tokens
    )


# ---------------------------------------------------------------------------- bad model files
@pytest.fixture(scope="module")
def good_bytes(gguf_model) -> bytes:
    return Path(gguf_model("F32", "tiny", 0)).read_bytes()


ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine"


def _raised_in_engine(exc: BaseException) -> bool:
    """The error is raised by engine code (a checked condition), not deep inside torch/numpy."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return Path(frame.filename).resolve().is_relative_to(ENGINE_DIR)  # engine/ and its parts


def _patch_u32_after(data: bytes, key: bytes, value: int) -> bytes:
    """Overwrite the uint32 value of metadata `key` (layout: key, u32 type, u32 value)."""
    at = data.index(key) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 4  # GGUF type UINT32
    return data[: at + 4] + struct.pack("<I", value) + data[at + 8 :]


def _cut(fraction_of_header: float | None = None, *, tensor_bytes: int = 0):
    def mutate(data: bytes, data_offset: int) -> bytes:
        if fraction_of_header is not None:
            return data[: int(data_offset * fraction_of_header)]
        return data[: data_offset + tensor_bytes]

    return mutate


BAD_FILES = {
    "empty": (lambda d, o: b"", "empty"),
    "text file": (lambda d, o: b"not a model at all\n" * 20, "not a GGUF file"),
    "wrong magic": (lambda d, o: b"GGML" + d[4:], "not a GGUF file"),
    "cut in the fixed header": (lambda d, o: d[:12], "truncated"),
    "cut in the metadata": (_cut(0.01), "truncated"),
    "cut in the vocabulary": (_cut(0.5), "truncated"),
    "cut before the tensor data": (_cut(0.9999), "truncated"),
    "cut inside the tensor data": (_cut(tensor_bytes=1000), "truncated"),
    "last byte missing": (lambda d, o: d[:-1], "truncated"),
    "unsupported version": (lambda d, o: d[:4] + struct.pack("<I", 99) + d[8:], "version"),
    "architecture value": (
        lambda d, o: d.replace(
            b"\x06\x00\x00\x00\x00\x00\x00\x00qwen35", b"\x06\x00\x00\x00\x00\x00\x00\x00llama3", 1
        ),
        "architecture",
    ),
    "hidden size disagrees with tensors": (
        lambda d, o: _patch_u32_after(d, b"qwen35.embedding_length", 96),
        "shape",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_model_file_gives_a_clear_error_naming_the_path(good_bytes, tmp_path: Path, case: str) -> None:
    mutate, message = BAD_FILES[case]
    offset = open_gguf_offset(good_bytes, tmp_path)
    bad = tmp_path / "bad model.gguf"
    bad.write_bytes(mutate(good_bytes, offset))
    with pytest.raises(GGUFError, match=message) as info:
        Engine.load(bad)
    assert str(bad) in str(info.value)
    assert _raised_in_engine(info.value), "".join(traceback.format_tb(info.value.__traceback__)[-1:])


def open_gguf_offset(good: bytes, tmp_path: Path) -> int:
    """Where the tensor data starts in the good file (to cut at known places)."""
    p = tmp_path / "good.gguf"
    p.write_bytes(good)
    return open_gguf(p).data_offset


def test_missing_model_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        Engine.load(missing)


def test_other_architecture_file_is_named_as_such(good_bytes, tmp_path: Path) -> None:
    # A whole file of another architecture: every qwen35 spelling (arch, keys, pre-tokenizer) renamed.
    bad = tmp_path / "llama.gguf"
    bad.write_bytes(good_bytes.replace(b"qwen35", b"llama3"))
    with pytest.raises(GGUFError, match="architecture") as info:
        Engine.load(bad)
    assert str(bad) in str(info.value)


def test_missing_tokenizer_metadata_is_named(good_bytes, tmp_path: Path) -> None:
    bad = tmp_path / "notok.gguf"
    bad.write_bytes(good_bytes.replace(b"tokenizer.ggml.tokens", b"tokenizer.ggml.tokenz", 1))
    with pytest.raises(GGUFError, match="tokenizer.ggml.tokens") as info:
        Engine.load(bad)
    assert str(bad) in str(info.value)


def test_oversized_request_is_rejected_not_run(gguf_model) -> None:
    from engine.engine import Engine
    from engine.types import DecideRequest
    from schemas.systemone import SystemOneRequest

    # the limit covers the whole first-stage prompt: system prefix, evidence, question
    eng = Engine.load(gguf_model("Q8_0", "tiny"), cache_bytes=0, max_request_tokens=100)
    small = SystemOneRequest.model_validate({"state": "ok", "questions": {"q": {"type": "noul"}}})
    big = SystemOneRequest.model_validate({"state": "disk full " * 100, "questions": {"q": {"type": "noul"}}})
    results = eng.decide([DecideRequest("big", big), DecideRequest("small", small, gate=0.0)])
    assert results[0].error is not None and "limit of 100" in results[0].error and not results[0].answers
    assert results[1].error is None and set(results[1].answers) == {"q"}
