"""Short requests and long thoughts (the dispatcher over the real engine): one batched with a long
thought is answered after the first read-outs; one arriving mid-thought runs between two of its
steps; either way with the bits it has alone."""

from __future__ import annotations

import asyncio

from engine.engine import Engine
from engine.types import CancelToken, DecideRequest, DecideResult
from prism_pipeline.serve.dispatcher import EngineDispatcher
from schemas.systemone import SystemOneRequest


def _req(event_id: str, gate: float, **kw: object) -> DecideRequest:
    body = SystemOneRequest.model_validate(
        {"state": f"disk full on {event_id}", "questions": {"q": {"type": "noul"}}}
    )
    return DecideRequest(event_id, body, gate=gate, thought_budget=100_000, max_thought_budget=100_000, **kw)  # type: ignore[arg-type]


def test_a_short_request_does_not_wait_for_its_batchs_thoughts(engine: Engine) -> None:
    async def run() -> None:
        batches = []
        dispatcher = EngineDispatcher(engine, max_tokens=8192, max_wait_s=0.2, on_batch=batches.append)
        await dispatcher.start()
        token = CancelToken()
        try:
            long = asyncio.ensure_future(dispatcher.decide(_req("long", 1.0, cancel=token), 64))
            short = asyncio.ensure_future(dispatcher.decide(_req("short", 0.0), 64))
            result = await asyncio.wait_for(short, 120)
            assert result.answers and result.output_tokens == 0
            assert not long.done()  # still thinking (a 100,000-token budget)
            token.cancel()
            assert (await asyncio.wait_for(long, 120)).stopped == "cancelled"
        finally:
            token.cancel()
            await dispatcher.stop()
        assert [b.requests for b in batches] == [2]  # one engine call held both
        assert batches[0].stopped == {"cancelled": 1}

    asyncio.run(run())


class _Steps(CancelToken):
    """Never fires; counts how often the engine looked (once per thought step)."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        return super().is_set()


def test_a_short_request_arriving_mid_thought_runs_between_its_steps(engine: Engine) -> None:
    async def run() -> DecideResult:
        dispatcher = EngineDispatcher(engine, max_tokens=8192, max_wait_s=0.0)
        await dispatcher.start()
        token = _Steps()
        try:
            long = asyncio.ensure_future(dispatcher.decide(_req("long2", 1.0, cancel=token), 64))
            while token.looks < 3:  # the long call is thinking
                await asyncio.sleep(0.01)
            result = await asyncio.wait_for(dispatcher.decide(_req("short2", 0.0), 64), 120)
            assert result.answers and not long.done()
            assert dispatcher.side_runs == 1
            token.cancel()
            assert (await asyncio.wait_for(long, 120)).stopped == "cancelled"
        finally:
            token.cancel()
            await dispatcher.stop()
        return result

    result = asyncio.run(run())
    oracle = engine.decide([_req("short2", 0.0)])[0]
    assert result.answers == oracle.answers and result.traces == oracle.traces
