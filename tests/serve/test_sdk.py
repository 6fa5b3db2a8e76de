"""The official `typesafe-sdk` client against `prism serve`: sync and async, configured only through
its documented environment variables (TYPESAFE_BASE_URL, TYPESAFE_API_KEY, TYPESAFE_DEFAULT_MODEL).

Oracle: the engine answering the same request in-process. A request alone in its batch is the same
computation, so its answers must be identical; requests that shared a forest with others (the async
test) are on the fp32 path, which is not batch invariant, so they match to fp32 rounding.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
from serve_helpers import API_KEY, Served, batch_counts
from typesafe_sdk import (
    AsyncTypeSafeClient,
    Choice,
    Noul,
    Score,
    TypeSafeAuthenticationError,
    TypeSafeBadRequestError,
    TypeSafeClient,
    TypeSafeNotFoundError,
    TypeSafeUnprocessableEntityError,
)
from typesafe_sdk.constants import API_KEY_ENV, BASE_URL_ENV, DEFAULT_MODEL_ENV

from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

FP32_BATCH_TOLERANCE = 1e-5  # fp32 forests of different sizes differ only by rounding

QUESTIONS = {
    "billing": Noul(instructions="Is this message about billing?"),
    "tone": Choice(
        instructions="What is the tone of the message?",
        criteria={"calm": "A neutral or polite message", "angry": "An upset message", "excited": None},
    ),
    "urgency": Score(instructions="How urgent is it?", criteria=["Can wait", "This week", "Today"]),
}
WIRE_QUESTIONS = {
    "billing": {"type": "noul", "instructions": "Is this message about billing?"},
    "tone": {
        "type": "choice",
        "instructions": "What is the tone of the message?",
        "criteria": {"calm": "A neutral or polite message", "angry": "An upset message", "excited": None},
    },
    "urgency": {
        "type": "score",
        "instructions": "How urgent is it?",
        "criteria": ["Can wait", "This week", "Today"],
    },
}


@pytest.fixture
def sdk_env(monkeypatch: pytest.MonkeyPatch, open_server: Served) -> Iterator[Served]:
    monkeypatch.setenv(BASE_URL_ENV, open_server.url)
    monkeypatch.setenv(API_KEY_ENV, "unused-by-an-open-server")
    monkeypatch.setenv(DEFAULT_MODEL_ENV, open_server.engine.model_name)
    yield open_server


def oracle(served: Served, state: object) -> dict[str, dict]:
    req = SystemOneRequest.model_validate({"state": state, "questions": WIRE_QUESTIONS})
    result = served.engine.decide([DecideRequest("oracle", req, gate=served.config.gate)])[0]
    assert result.error is None
    return {k: a.model_dump() for k, a in result.answers.items()}, result.input_tokens


def assert_matches(resp, want: dict[str, dict], tol: float) -> None:  # noqa: ANN001 - an SDK response
    assert set(resp.answers) == set(want)
    noul = resp.nouls["billing"]
    assert noul.noul == pytest.approx(want["billing"]["noul"], abs=tol, rel=0)
    choice = resp.choices["tone"]
    assert choice.choice == want["tone"]["choice"]
    assert list(choice.probabilities) == list(want["tone"]["probabilities"])  # display order kept
    for k, p in choice.probabilities.items():
        assert p == pytest.approx(want["tone"]["probabilities"][k], abs=tol, rel=0)
    score = resp.scores["urgency"]
    # The SDK turns score keys into ints; the wire keys are "0".."n-1".
    assert score.probabilities == pytest.approx(
        {int(k): v for k, v in want["urgency"]["probabilities"].items()}, abs=tol, rel=0
    )
    assert score.legend == {0: "Can wait", 1: "This week", 2: "Today"}
    assert score.score == pytest.approx(sum(i * p for i, p in score.probabilities.items()), abs=1e-9)
    assert math.isclose(sum(choice.probabilities.values()), 1.0, abs_tol=1e-6)


def assert_alone_in_its_batch(served: Served, before: tuple[float, float]) -> None:
    """The zero tolerance below holds for a request decided alone (fp32 is not batch invariant,
    README): one batch of one request since `before`, else the comparison would test an accident."""
    batches, requests = batch_counts(served)
    assert (batches - before[0], requests - before[1]) == (1, 1)


def test_sync_client_gets_parsed_answers(sdk_env: Served) -> None:
    state = "Customer writes: I was charged twice for my subscription this month. Please refund one."
    # An earlier test's request must not share this one's batch, nor the engine with the oracle.
    before = batch_counts(sdk_env)
    want, input_tokens = oracle(sdk_env, state)
    with TypeSafeClient() as client:
        resp = client.system_one(state=state, questions=QUESTIONS)
        models = client.models.list()
    assert_alone_in_its_batch(sdk_env, before)
    assert resp.model == sdk_env.engine.model_name
    assert_matches(resp, want, tol=0.0)  # alone in its batch: the very same computation
    assert resp.usage.input_tokens == input_tokens and resp.usage.output_tokens == 0
    assert resp.request_id.startswith("req_")
    assert [m.name for m in models.models] == [sdk_env.engine.model_name]


def test_sync_client_json_state(sdk_env: Served) -> None:
    state = {"ticket": 4512, "subject": "Double charge", "body": "Charged twice", "tags": ["billing"]}
    before = batch_counts(sdk_env)
    want, _ = oracle(sdk_env, state)
    with TypeSafeClient() as client:
        resp = client.system_one(state=state, questions=QUESTIONS)
    assert_alone_in_its_batch(sdk_env, before)
    assert_matches(resp, want, tol=0.0)


def test_async_client_concurrent_requests_are_batched(sdk_env: Served) -> None:
    states = [
        f"Message {i}: the {w} arrived {d}."
        for i, (w, d) in enumerate(
            [
                ("invoice", "late"),
                ("parcel", "broken"),
                ("refund", "twice"),
                ("bill", "early"),
                ("order", "today"),
                ("card", "blocked"),
            ]
        )
    ]
    before, before_sum = batch_counts(sdk_env)  # an earlier test's batch must not land in this window

    async def main() -> list:
        async with AsyncTypeSafeClient() as client:
            return await asyncio.gather(*(client.system_one(state=s, questions=QUESTIONS) for s in states))

    responses = asyncio.run(main())
    batches, requests = (a - b for a, b in zip(batch_counts(sdk_env), (before, before_sum), strict=True))
    assert requests == len(states)
    assert batches < len(states), "concurrent requests should share engine batches"
    for state, resp in zip(states, responses, strict=True):
        want, _ = oracle(sdk_env, state)
        assert_matches(resp, want, tol=FP32_BATCH_TOLERANCE)


def test_sdk_raises_the_matching_errors(sdk_env: Served, auth_server: Served) -> None:
    with TypeSafeClient() as client:
        with pytest.raises(TypeSafeNotFoundError, match="not served here"):
            client.system_one(state="x", questions=QUESTIONS, model="jev-latest")
        with pytest.raises(TypeSafeBadRequestError, match="criteria") as bad:
            client.system_one(state="x", questions={"q": {"type": "choice", "criteria": {"a": None}}})
        assert bad.value.request_id is not None and bad.value.request_id.startswith("req_")
        with pytest.raises(TypeSafeUnprocessableEntityError, match="images"):
            client.system_one(state="x", questions=QUESTIONS, extra_body={"images": ["aGVsbG8="]})
    with (
        TypeSafeClient(base_url=auth_server.url, api_key="wrong") as client,
        pytest.raises(TypeSafeAuthenticationError),
    ):
        client.system_one(state="x", questions=QUESTIONS)
    with TypeSafeClient(base_url=auth_server.url, api_key=API_KEY) as client:
        resp = client.system_one(state="x", questions=QUESTIONS)
        assert set(resp.answers) == set(QUESTIONS)
