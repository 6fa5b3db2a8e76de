"""`prism backfill`: records equal the engine's own decisions, invalid lines go to the DLQ with their
reasons, and a job killed at any point then resumed writes exactly what an uninterrupted run writes."""

from __future__ import annotations

import asyncio
import base64
import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from prism_pipeline.core.batching import pack
from prism_pipeline.core.records import build_record, decide_request, provenance
from prism_pipeline.offline.backfill import CRASH_ENV, BackfillOptions, run_backfill
from prism_pipeline.offline.checkpoint import read_checkpoint
from prism_pipeline.offline.engines import EngineSource
from prism_pipeline.offline.errors import BackfillError
from prism_pipeline.offline.replay import replay
from prism_pipeline.offline.report import render_report
from prism_pipeline.offline.selection import Selection
from prism_pipeline.offline.sources import FileSource, TopicSource
from schemas.codec import dumps
from schemas.deadletter import classify_invalid, parse_event
from tests.pipeline.conftest import TEST_GATE, TEST_THOUGHT_BUDGET
from tests.pipeline.kafkautil import REPO, create_topics, encode, event, produce, read_all, unique

CHUNK = 3


def write_events(path: Path, n: int = 10) -> list[bytes]:
    """n valid events (one of them thinks), two invalid lines and a blank one; returns the lines."""
    evs = [event(i, prefix="bf") for i in range(n)]
    evs[2]["gate"] = 1.0  # AutoThink: the thought's sampling must survive a restart too
    lines = [encode(e) for e in evs]
    lines.insert(4, b'{"event_id": "bf-broken", "source": ')
    lines.insert(7, b"")
    lines.insert(8, encode({**event(99, prefix="bf"), "source": "pager"}))
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return lines


def backfill(engine, src: Path, out: Path, **kw) -> object:
    opts = BackfillOptions(chunk_events=kw.pop("chunk_events", CHUNK), **kw)
    return asyncio.run(
        run_backfill(
            engine,
            FileSource([src]),
            output=out,
            dlq=out.with_name(out.name + ".dlq.jsonl"),
            checkpoint=out.with_name(out.name + ".checkpoint"),
            options=opts,
        )
    )


def test_batches_respect_the_token_budget() -> None:
    items = [("a", 5), ("b", 5), ("c", 1), ("d", 20), ("e", 2)]
    assert pack(items, 10, 10) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert pack(items, 100, 2) == [["a", "b"], ["c", "d"], ["e"]]


def test_records_are_the_engines_decisions_and_bad_lines_are_dead_lettered(
    tiny_engine, tmp_path: Path
) -> None:
    src = tmp_path / "events.jsonl"
    lines = write_events(src)
    out = tmp_path / "records.jsonl"
    # One event per engine call: the oracle below decides each event alone, the same way.
    summary = backfill(tiny_engine, src, out, max_batch_events=1)

    model = provenance(tiny_engine)
    expected = []
    for line in lines:
        if not line or classify_invalid(line) is not None:
            continue
        ev = parse_event(line)
        req = decide_request(ev)
        (res,) = tiny_engine.decide([req])
        expected.append(dumps(build_record(ev, req, res, model, None)))
    assert out.read_bytes().splitlines() == expected

    dead = [orjson.loads(x) for x in out.with_name(out.name + ".dlq.jsonl").read_bytes().splitlines()]
    bad = [(n, line) for n, line in enumerate(lines) if line and classify_invalid(line) is not None]
    assert [(d["offset"], base64.b64decode(d["original_b64"])) for d in dead] == bad
    assert [d["reason"] for d in dead] == [str(classify_invalid(line).reason) for _, line in bad]
    assert all(d["topic"] == str(src) and d["partition"] == 0 and d["message"] for d in dead)

    assert (summary.events, summary.records, summary.dead_letters) == (12, 10, 2)
    assert summary.questions == 30 and summary.thought_questions >= 1
    assert summary.autothink_rate == summary.thought_questions / 30
    state = read_checkpoint(out.with_name(out.name + ".checkpoint"))
    assert state is not None and state["done"] and state["chunks"] == 4


def _cli(
    src: Path, out: Path, tiny_model: Path, env: dict[str, str] | None = None, *extra: str
) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "prism_pipeline.cli", "--log-json", "backfill", str(src), "-o", str(out),
        "--model", str(tiny_model), "--precision", "fp32", "--gate", str(TEST_GATE),
        "--thought-budget", str(TEST_THOUGHT_BUDGET), "--chunk-events", str(CHUNK), *extra,
    ]  # fmt: skip
    full_env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    return subprocess.Popen(
        args, cwd=REPO, env={**full_env, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def _uninterrupted(src: Path, out: Path, tiny_model: Path) -> None:
    # The reference is a fresh process too: fp32 is only promised reproducible for the same batches
    # from the same state (a warm prefix cache may differ in the last bits), int8 everywhere.
    proc = _cli(src, out, tiny_model)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]


@pytest.mark.slow  # three engine loads in subprocesses
@pytest.mark.parametrize(
    ("crash", "suffix"),
    [("2:mid-output", ".jsonl.gz"), ("3:before-checkpoint", ".jsonl")],
)
def test_crash_then_resume_equals_an_uninterrupted_run(
    crash: str, suffix: str, tiny_model: Path, tmp_path: Path
) -> None:
    src = tmp_path / f"events{suffix}"
    write_events(src)
    reference = tmp_path / f"reference{suffix}"
    _uninterrupted(src, reference, tiny_model)

    out = tmp_path / f"records{suffix}"
    killed = _cli(src, out, tiny_model, {CRASH_ENV: crash})
    _, err = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, err.decode()[-2000:]
    state = read_checkpoint(out.with_name(out.name + ".checkpoint"))
    done_chunks = int(crash.split(":")[0]) - 1
    assert state is not None and state["chunks"] == done_chunks and not state["done"]
    # The crash left bytes past the checkpoint (a torn chunk, or a whole uncommitted one).
    assert out.stat().st_size > state["output_bytes"]

    resumed = _cli(src, out, tiny_model)
    stdout, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err.decode()[-2000:]
    assert out.read_bytes() == reference.read_bytes()
    dlq = out.with_name(out.name + ".dlq.jsonl").read_bytes()
    assert dlq == reference.with_name(reference.name + ".dlq.jsonl").read_bytes()
    text = stdout.decode()
    assert f"resumed after {done_chunks * CHUNK}" in text and "events/s" in text and "AutoThink" in text
    records = (gzip.decompress if suffix.endswith(".gz") else bytes)(out.read_bytes()).splitlines()
    ids = [orjson.loads(r)["event_id"] for r in records]
    assert ids == [f"bf-{i:04d}" for i in range(10)]  # no gap, no duplicate, input order


@pytest.mark.slow
def test_sigkill_at_an_arbitrary_moment_then_resume(tiny_model: Path, tmp_path: Path) -> None:
    src = tmp_path / "events.jsonl"
    write_events(src, n=30)
    reference = tmp_path / "reference.jsonl"
    _uninterrupted(src, reference, tiny_model)

    out = tmp_path / "records.jsonl"
    ckpt = out.with_name(out.name + ".checkpoint")
    proc = _cli(src, out, tiny_model)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        state = read_checkpoint(ckpt) if ckpt.exists() else None
        if state is not None and state["chunks"] >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    state = read_checkpoint(ckpt)
    assert proc.returncode == -signal.SIGKILL and state is not None and not state["done"]

    resumed = _cli(src, out, tiny_model)
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err.decode()[-2000:]
    assert out.read_bytes() == reference.read_bytes()


def test_a_checkpoint_resumes_only_its_own_job(tiny_engine, tmp_path: Path) -> None:
    src = tmp_path / "events.jsonl"
    write_events(src, n=4)
    out = tmp_path / "records.jsonl"
    backfill(tiny_engine, src, out)
    first = out.read_bytes()
    again = backfill(tiny_engine, src, out)  # complete: nothing redone
    assert again.already_complete and out.read_bytes() == first
    with pytest.raises(BackfillError, match="chunk_events"):
        backfill(tiny_engine, src, out, chunk_events=CHUNK + 1)
    out.with_name(out.name + ".checkpoint").unlink()
    with pytest.raises(BackfillError, match="--overwrite"):
        backfill(tiny_engine, src, out)
    backfill(tiny_engine, src, out, overwrite=True)
    assert out.read_bytes() == first


@pytest.mark.kafka
async def test_topic_range_to_topic_replays_identical(
    kafka_bootstrap: str, tiny_engine, tmp_path: Path
) -> None:
    tin, tout = unique("bf-in"), unique("bf-out")
    await create_topics(kafka_bootstrap, {tin: 2, tout: 1})
    evs = [event(i, prefix="bft") for i in range(8)]
    await produce(kafka_bootstrap, tin, [(None, encode(e), i % 2) for i, e in enumerate(evs)])
    await produce(kafka_bootstrap, tin, [(None, b"not json", 1)])
    summary = await run_backfill(
        tiny_engine,
        TopicSource(kafka_bootstrap, tin),
        output_topic=(kafka_bootstrap, tout),
        dlq=tmp_path / "dlq.jsonl",
        checkpoint=tmp_path / "ckpt",
        options=BackfillOptions(chunk_events=4),
    )
    assert (summary.events, summary.records, summary.dead_letters) == (9, 8, 1)
    msgs = await read_all(kafka_bootstrap, [tout], 8, settle=0.2)
    assert sorted(m.key for m in msgs) == sorted(e["event_id"].encode() for e in evs)
    # The records carry their input positions and batches, so `prism replay` checks them (fp32 path).
    report = await replay(kafka_bootstrap, tout, Selection(topic=tin), EngineSource(engines=[tiny_engine]))
    assert report.ok and report.count("identical") == 8 and report.count("invalid") == 1, render_report(
        report
    )


@pytest.mark.slow  # three engine processes
def test_tp2_backfill_writes_the_bytes_of_one_process(tiny_model: Path, tmp_path: Path) -> None:
    """`--tp 2` (two gloo ranks, int8) writes the output file of a single-process int8 job, byte for byte."""
    src = tmp_path / "events.jsonl"
    write_events(src)
    outs = {}
    for tp in ("1", "2"):
        out = tmp_path / f"tp{tp}.jsonl"
        proc = _cli(src, out, tiny_model, None, "--precision", "int8", "--tp", tp)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-2000:]
        outs[tp] = out.read_bytes()
    assert outs["1"].count(b"\n") == 10  # every valid event decided
    assert outs["2"] == outs["1"]
