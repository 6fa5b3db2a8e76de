"""`prism backfill --processes N`: N shard processes, one killed mid-way and resumed, merge to the
one output a single process writes, byte for byte (int8: batch invariant and state independent,
so the oracle is a single-process job in this process)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import orjson
import pytest

from prism_pipeline.offline.backfill import CRASH_ENV, BackfillOptions, run_backfill
from prism_pipeline.offline.checkpoint import read_checkpoint
from prism_pipeline.offline.errors import BackfillError
from prism_pipeline.offline.shards import Shard, merge_shards
from prism_pipeline.offline.sources import FileSource, TopicSource
from tests.pipeline.conftest import TEST_GATE, TEST_THOUGHT_BUDGET
from tests.pipeline.kafkautil import create_topics, encode, event, produce, unique

CHUNK = 3
N_EVENTS = 18


def write_events(path: Path) -> list[str]:
    """N_EVENTS valid events (two of them think), two invalid lines; returns the valid ids in order."""
    evs = [event(i, prefix="bp") for i in range(N_EVENTS)]
    evs[1]["gate"] = evs[9]["gate"] = 1.0  # AutoThink in a chunk of each shard
    lines = [encode(e) for e in evs]
    lines.insert(5, b'{"event_id": "bp-broken", "source": ')
    lines.insert(13, b"not json")
    path.write_bytes(b"\n".join(lines) + b"\n")
    return [e["event_id"] for e in evs]


def oracle(engine, source: FileSource | TopicSource, out: Path) -> None:
    """The single-process job: the merged output must be its files, byte for byte."""
    _shard(engine, source, out, None)


def _cli(src: Path, out: Path, tiny_model: Path) -> int:
    """`prism backfill --processes 2` run here (the parent spawns its two shard processes)."""
    from prism_pipeline.cli.main import build_parser

    # The command's own entry, less main()'s logging setup (which would bind this process's
    # structlog to the test's captured, later closed, stderr).
    args = build_parser().parse_args([
        "--log-json", "backfill", str(src), "-o", str(out), "--model", str(tiny_model),
        "--precision", "int8", "--gate", str(TEST_GATE), "--thought-budget", str(TEST_THOUGHT_BUDGET),
        "--chunk-events", str(CHUNK), "--processes", "2",
    ])  # fmt: skip
    return int(args.func(args))


@pytest.mark.slow  # two shard processes twice, each loading the engine
def test_two_processes_one_killed_and_resumed_merge_to_the_single_process_output(
    int8_engine,
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
) -> None:
    src = tmp_path / "events.jsonl"
    ids = write_events(src)
    reference = tmp_path / "reference.jsonl"
    oracle(int8_engine, FileSource([src]), reference)

    out = tmp_path / "records.jsonl"
    ckpt = out.with_name(out.name + ".checkpoint")
    # Chunk 4 (global, 1-based) is shard 2's second chunk: that process dies half-way through
    # writing it; shard 1 runs to its end.
    monkeypatch.setenv(CRASH_ENV, "4:mid-output")
    assert _cli(src, out, tiny_model) == 1
    assert f"shard(s) 2/2 (exit {-signal.SIGKILL}) did not finish" in capfd.readouterr().err
    one, two = (read_checkpoint(Shard(k, 2).path(ckpt)) for k in (1, 2))
    assert one is not None and one["done"]
    assert two is not None and not two["done"] and two["chunks"] == 1 and two["next_chunk"] == 2
    assert Shard(2, 2).path(out).stat().st_size > two["output_bytes"]  # a torn chunk past the checkpoint
    assert not out.exists()

    monkeypatch.delenv(CRASH_ENV)
    code = _cli(src, out, tiny_model)
    stdout, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert out.read_bytes() == reference.read_bytes()
    dlq = out.with_name(out.name + ".dlq.jsonl")
    assert dlq.read_bytes() == reference.with_name(reference.name + ".dlq.jsonl").read_bytes()
    assert [orjson.loads(r)["event_id"] for r in out.read_bytes().splitlines()] == ids  # no gap, no dup
    done_before = one["counters"]["events"] + two["counters"]["events"]
    assert f"20 events ({20 - done_before} in this run, resumed after {done_before})" in stdout
    assert not Shard(1, 2).path(out).exists() and not Shard(2, 2).path(out).exists()  # merged, removed
    # Run again, the merge finds its checkpoint complete: nothing is redone.
    assert merge_shards(out, dlq, ckpt, 2)[1] and out.read_bytes() == reference.read_bytes()


def _shard(engine, source, out: Path, shard: Shard | None, chunk_events: int = CHUNK):
    return asyncio.run(
        run_backfill(
            engine,
            source,
            output=out,
            dlq=out.with_name(out.name + ".dlq.jsonl"),
            checkpoint=out.with_name(out.name + ".checkpoint"),
            options=BackfillOptions(chunk_events=chunk_events),
            shard=shard,
        )
    )


def test_merge_refuses_unfinished_or_mismatched_shards(int8_engine, tmp_path: Path) -> None:
    src = tmp_path / "events.jsonl"
    write_events(src)
    out = tmp_path / "records.jsonl"
    ckpt, dlq = out.with_name(out.name + ".checkpoint"), out.with_name(out.name + ".dlq.jsonl")
    first = _shard(int8_engine, FileSource([src]), out, Shard(1, 2))
    assert first.events == 11  # chunks 0, 2, 4, 6 of 7: 3 + 3 + 3 + 2 events
    with pytest.raises(BackfillError, match=r"shard\(s\) 2/2 not finished"):
        merge_shards(out, dlq, ckpt, 2)
    _shard(int8_engine, FileSource([src]), out, Shard(2, 2), chunk_events=CHUNK + 1)
    with pytest.raises(BackfillError, match="shard 2/2 ran another job.*chunk_events"):
        merge_shards(out, dlq, ckpt, 2)
    assert not out.exists()


@pytest.mark.kafka
async def test_a_topic_range_over_two_shards_merges_to_the_single_process_output(
    kafka_bootstrap: str, int8_engine, tmp_path: Path
) -> None:
    tin = unique("bp-in")
    await create_topics(kafka_bootstrap, {tin: 2})
    evs = [event(i, prefix="bpt") for i in range(14)]
    await produce(kafka_bootstrap, tin, [(None, encode(e), i % 2) for i, e in enumerate(evs)])
    await produce(kafka_bootstrap, tin, [(None, b"not json", 0)])
    reference = tmp_path / "reference.jsonl"
    await asyncio.to_thread(oracle, int8_engine, TopicSource(kafka_bootstrap, tin), reference)

    out = tmp_path / "records.jsonl"
    fixed = TopicSource(kafka_bootstrap, tin)
    await fixed.resolve()  # the parent fixes the range once; every shard reads that range
    ranges = fixed.describe()["ranges"]
    for k in (1, 2):
        source = TopicSource(kafka_bootstrap, tin, ranges=ranges)
        await asyncio.to_thread(_shard, int8_engine, source, out, Shard(k, 2))
    ckpt, dlq = out.with_name(out.name + ".checkpoint"), out.with_name(out.name + ".dlq.jsonl")
    state, already = merge_shards(out, dlq, ckpt, 2)
    assert not already and state["counters"]["events"] == 15 and state["counters"]["records"] == 14
    assert out.read_bytes() == reference.read_bytes()
    assert dlq.read_bytes() == reference.with_name(reference.name + ".dlq.jsonl").read_bytes()
    assert merge_shards(out, dlq, ckpt, 2)[1]  # a second merge finds it done


def test_a_shard_is_k_of_n() -> None:
    assert [g for g in range(9) if Shard(2, 3).owns(g)] == [1, 4, 7]
    assert Shard(2, 4).path(Path("/d/records.jsonl.gz")) == Path("/d/records.jsonl.shard-2-of-4.gz")
    assert sum(Shard(k, 3).share(31, 4) for k in (1, 2, 3)) == 31
    with pytest.raises(BackfillError):
        Shard(0, 2)
