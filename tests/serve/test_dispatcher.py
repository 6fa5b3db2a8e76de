"""`EngineDispatcher`: concurrent requests become engine batches on one dedicated thread.

The engine is the real one; `Recording` only notes which thread called it with which requests.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.engine import Engine
from engine.types import DecideRequest, DecideResult
from prism_pipeline.serve.dispatcher import BatchStats, DispatcherClosed, EngineDispatcher, Overloaded
from schemas.systemone import SystemOneRequest


class Recording:
    def __init__(self, engine: Engine, fail_on: str | None = None) -> None:
        self.engine = engine
        self.fail_on = fail_on
        self.calls: list[tuple[int, list[str]]] = []

    def decide(self, requests: list[DecideRequest]) -> list[DecideResult]:
        ids = [r.request_id for r in requests]
        self.calls.append((threading.get_ident(), ids))
        if self.fail_on in ids:
            raise ValueError(f"cannot decide {self.fail_on}")
        return self.engine.decide(requests)


def request(i: int) -> DecideRequest:
    req = SystemOneRequest.model_validate(
        {
            "state": f"ticket {i}: the refund is late",
            "questions": {"q": {"type": "noul", "instructions": "Late?"}},
        }
    )
    return DecideRequest(f"r{i}", req, gate=0.0)


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_concurrent_requests_share_one_engine_call_off_the_loop(engine: Engine) -> None:
    rec = Recording(engine)
    stats: list[BatchStats] = []

    async def main() -> tuple[int, list[DecideResult]]:
        d = EngineDispatcher(rec, max_tokens=100_000, max_wait_s=0.2, on_batch=stats.append)
        await d.start()
        reqs = [request(i) for i in range(5)]
        results = await asyncio.gather(*(d.decide(r, engine.count_tokens(r.request)) for r in reqs))
        await d.stop()
        return threading.get_ident(), results

    loop_thread, results = run(main())
    assert len(rec.calls) == 1
    thread, ids = rec.calls[0]
    assert thread != loop_thread
    assert ids == [f"r{i}" for i in range(5)]  # arrival order
    assert [r.request_id for r in results] == ids  # each future got its own result
    for i, res in enumerate(results):
        solo = engine.decide([request(i)])[0]
        assert res.answers["q"].noul == pytest.approx(solo.answers["q"].noul, abs=1e-5, rel=0)
    assert stats[0].requests == 5 and len(stats[0].queue_seconds) == 5


def test_a_batch_is_counted_in_the_engine_until_its_stats_are_recorded(engine: Engine) -> None:
    """`in_engine` is what a reader of the batch stats waits on (tests/serve/serve_helpers.py):
    it must cover the engine call and the recording of the batch's stats, and end after both."""
    seen: dict[str, int] = {}
    stats: list[BatchStats] = []

    class Watching(Recording):
        def decide(self, requests: list[DecideRequest]) -> list[DecideResult]:
            seen["during_call"] = d.in_engine
            return super().decide(requests)

    def on_batch(s: BatchStats) -> None:
        seen["at_record"] = d.in_engine
        stats.append(s)

    d = EngineDispatcher(Watching(engine), max_tokens=100_000, max_wait_s=0.05, on_batch=on_batch)

    async def main() -> None:
        await d.start()
        seen["before"] = d.in_engine
        reqs = [request(i) for i in range(3)]
        await asyncio.gather(*(d.decide(r, engine.count_tokens(r.request)) for r in reqs))
        await d.stop()

    run(main())
    assert seen == {"before": 0, "during_call": 1, "at_record": 1}
    assert d.in_engine == 0 and sum(s.requests for s in stats) == 3


def test_token_budget_splits_batches_and_one_thread_runs_them_all(engine: Engine) -> None:
    rec = Recording(engine)
    tokens = engine.count_tokens(request(0).request)

    async def main() -> None:
        # Room for two requests per batch.
        d = EngineDispatcher(rec, max_tokens=2 * tokens, max_wait_s=0.2)
        await d.start()
        await asyncio.gather(*(d.decide(request(i), tokens) for i in range(5)))
        await d.stop()

    run(main())
    assert [ids for _, ids in rec.calls] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert len({t for t, _ in rec.calls}) == 1


def test_a_failing_request_fails_alone(engine: Engine) -> None:
    rec = Recording(engine, fail_on="r1")

    async def main() -> list:
        d = EngineDispatcher(rec, max_tokens=100_000, max_wait_s=0.2)
        await d.start()
        out = await asyncio.gather(*(d.decide(request(i), 1) for i in range(3)), return_exceptions=True)
        await d.stop()
        return out

    out = run(main())
    assert isinstance(out[1], ValueError) and "r1" in str(out[1])
    assert [r.request_id for r in (out[0], out[2])] == ["r0", "r2"]
    # The batch, then each request on its own.
    assert [ids for _, ids in rec.calls] == [["r0", "r1", "r2"], ["r0"], ["r1"], ["r2"]]


def test_overload_and_shutdown(engine: Engine) -> None:
    rec = Recording(engine)

    async def main() -> DecideResult:
        d = EngineDispatcher(rec, max_tokens=100_000, max_wait_s=60.0, max_pending=1)
        await d.start()
        first = asyncio.create_task(d.decide(request(0), 1))
        await asyncio.sleep(0.05)  # waiting in the open batch (a minute-long window)
        with pytest.raises(Overloaded):
            await d.decide(request(1), 1)
        await d.stop()  # drains: the waiting request is answered, not dropped
        with pytest.raises(DispatcherClosed):
            await d.decide(request(2), 1)
        return await first

    assert run(main()).request_id == "r0"
    assert [ids for _, ids in rec.calls] == [["r0"]]


def test_bad_settings_are_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="max_pending"):
        EngineDispatcher(engine, max_tokens=10, max_wait_s=0.0, max_pending=0)
    with pytest.raises(ValueError, match="max_tokens"):
        EngineDispatcher(engine, max_tokens=0, max_wait_s=0.0)
