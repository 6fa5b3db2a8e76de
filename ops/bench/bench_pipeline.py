"""The pipeline alone: `prism run`'s own throughput and added latency, with an engine of declared cost.

    python ops/bench/bench_pipeline.py --partitions 1,4 --modes alo,eos --backlog 10000 \
        --latency-events 2000 --latency-rate 100 --cost-us 0 --out /tmp/bench_pipeline.json
    python ops/bench/bench_pipeline.py --partitions 1 --modes alo --profile /tmp/prof  (cProfile)

Why: every other measurement of the pipeline runs a model that takes 0.1-0.5 s an event on
CPU, so the pipeline's own cost (consume, validate, batch, build and publish records, commit)
has never been seen. Here the worker is the real `prism run` code (`ops.load.standin_engine`
wraps only its engine: a stand-in whose cost is `--cost-us` microseconds an event, declared)
against a real local single broker (`ops/kafka`), and what is measured beyond that cost is the
pipeline's.

For each input partition count and delivery mode (at-least-once, exactly-once), on fresh topics:
1. throughput: a backlog of `--backlog` valid events is produced first, then one worker starts;
   events/s = backlog / (last outcome's Kafka timestamp - first outcome's), so the worker's start
   (Python, torch import, group join) is not in it; the worker's CPU seconds over the same
   stretch (/proc) give its CPU cost per event;
2. added latency: with the worker idle, `--latency-events` events paced at `--latency-rate`/s
   (below its capacity, so nothing queues); a consumer in this process (read_committed) sees
   each event arrive on the input topic and its record on the output topic. Added latency =
   record visible - send() called - declared cost: p50 / p99. The input hop (send -> visible on
   the input topic) is reported beside it: the part of that which is Kafka's, not the worker's;
3. reconciliation: `ops.load.check` over every offset (0 lost, and 0 duplicates expected: no
   faults here), and every record parsed against the record contract (`DecisionRecord`).

The machine's 1-minute load average is recorded before and after each configuration (the
benchmark machine is shared). Worker flags are `prism run`'s defaults except `--max-wait-ms`
(`--max-wait-ms`, 0 here by default: the batching window is a latency the operator chooses, 20 ms
by default, and would otherwise be most of the figure).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from ops.load.check import Checker, percentile
from ops.load.events import EventMix
from ops.load.generate import Produced, generate
from ops.load.procs import WorkerProc
from ops.load.scenarios import create_topics
from prism_pipeline.local_kafka import LocalKafka
from schemas.record import DecisionRecord

MODES = {"alo": False, "eos": True}


@dataclass
class BenchConfig:
    partitions: int
    exactly_once: bool
    cost_us: float = 0.0
    backlog: int = 10_000
    latency_events: int = 2_000
    latency_rate: float = 100.0
    max_wait_ms: float = 0.0
    poison_fraction: float = 0.0  # the benchmark decides valid events; the test mixes poison in
    worker_flags: list[str] = field(default_factory=list)
    profile: Path | None = None  # write the worker's cProfile stats here

    @property
    def label(self) -> str:
        return f"{self.partitions}p-{'eos' if self.exactly_once else 'alo'}"


def _cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Watcher:
    """One end-offset probe kept open (cheap to poll, unlike reading and parsing the records)."""

    def __init__(
        self, bootstrap: str, topics: list[str], partitions: dict[str, int], read_committed: bool
    ) -> None:
        self._c = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            isolation_level="read_committed" if read_committed else "read_uncommitted",
        )
        self._tps = [TopicPartition(t, p) for t in topics for p in range(partitions[t])]

    async def __aenter__(self) -> Watcher:
        await self._c.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._c.stop()

    async def total(self) -> int:
        ends = await self._c.end_offsets(self._tps)
        return int(sum(ends.values()))


async def _arrivals(
    bootstrap: str, topics: dict[str, int], stop: asyncio.Event, seen: dict[str, dict[tuple[int, int], float]]
) -> None:
    """Record when each input message and each record becomes visible (read_committed), keyed by
    the input position: `seen["in"]`, `seen["out"]`. Starts at the topics' current ends."""
    c = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        fetch_max_wait_ms=100,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    await c.start()
    try:
        tps = [TopicPartition(t, p) for t, n in topics.items() for p in range(n)]
        c.assign(tps)
        ends = await c.end_offsets(tps)
        for tp in tps:
            c.seek(tp, ends[tp])
        in_topic = next(iter(topics))
        while not stop.is_set():
            got = await c.getmany(timeout_ms=50)
            now = time.time()
            for tp, msgs in got.items():
                for m in msgs:
                    if tp.topic == in_topic:
                        seen["in"][(m.partition, m.offset)] = now
                    else:
                        ref = orjson.loads(m.value).get("input") or {}
                        pos = (int(ref.get("partition", -1)), int(ref.get("offset", -1)))
                        seen["out"].setdefault(pos, now)
    finally:
        await c.stop()


async def _paced_send(
    bootstrap: str, topic: str, mix: EventMix, lo: int, n: int, rate: float
) -> tuple[dict[tuple[int, int], float], list[Produced]]:
    """n messages paced at `rate`/s; returns {(partition, offset): wall time send() was called} of
    those owed a record, and every message's manifest entry."""
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await p.start()
    sent: list[tuple[float, Any, asyncio.Future[Any]]] = []
    try:
        t0 = time.monotonic()
        for i in range(n):
            wait = t0 + i / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            msg = mix.message(lo + i)
            t = time.time()
            sent.append((t, msg, await p.send(topic, msg.value, key=msg.key)))
        out: dict[tuple[int, int], float] = {}
        produced: list[Produced] = []
        for t, msg, fut in sent:
            meta = await fut
            if msg.expect == "record":  # poison goes to the dead letters, not the latency figure
                out[(meta.partition, meta.offset)] = t
            key = msg.key.decode("utf-8", "replace")
            produced.append(
                Produced(
                    meta.partition,
                    meta.offset,
                    key,
                    msg.kind,
                    msg.expect,
                    msg.reason,
                    msg.label,
                    meta.timestamp,
                )
            )
        return out, produced
    finally:
        await p.stop()


async def _outcomes(bootstrap: str, record_topic: str, dlq_topic: str) -> tuple[list[int], int]:
    """Every outcome (read_committed): sorted Kafka timestamps of the records and dead letters, and
    how many records fail the record contract."""
    c = AIOKafkaConsumer(
        record_topic,
        dlq_topic,
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        auto_offset_reset="earliest",
    )
    await c.start()
    stamps: list[int] = []
    invalid = 0
    try:
        got = await c.getmany(timeout_ms=500)
        parts = sorted(c.assignment())
        ends = await c.end_offsets(parts)
        while True:
            for tp, msgs in got.items():
                for m in msgs:
                    stamps.append(m.timestamp)
                    if tp.topic != record_topic:
                        continue
                    try:
                        DecisionRecord.model_validate_json(m.value)
                    except ValueError:
                        invalid += 1
            if not [tp for tp in parts if await c.position(tp) < ends[tp]]:
                break
            got = await c.getmany(timeout_ms=500)
        return sorted(stamps), invalid
    finally:
        await c.stop()


def _ms(values: list[float], q: float) -> float | None:
    got = percentile(values, q)
    return None if got is None else round(got * 1000.0, 2)


def _profile_top(path: Path, n: int = 25) -> list[dict[str, Any]]:
    """The profile's functions with the most own time (tottime), with their cumulative time."""
    st = pstats.Stats(str(path))
    rows = []
    for (file, line, fn), (_cc, calls, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "fn": f"{Path(file).name}:{line}({fn})",
                "calls": calls,
                "tottime_s": round(tt, 3),
                "cumtime_s": round(ct, 3),
            }
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:n]


async def run_config(bootstrap: str, cfg: BenchConfig, workdir: Path) -> dict[str, Any]:
    tag = f"bench.{cfg.label}.{uuid.uuid4().hex[:6]}"
    tin, tout, tdlq = f"{tag}.in", f"{tag}.out", f"{tag}.dlq"
    parts = {tin: cfg.partitions, tout: 1, tdlq: 1}
    await create_topics(bootstrap, parts)
    mix = EventMix(tag, cfg.poison_fraction, 0)
    load1_before = os.getloadavg()[0]
    backlog = await generate(bootstrap, tin, count=cfg.backlog, producers=2, messages=mix.message)
    args = [
        "--standin-cost-us",
        str(cfg.cost_us),
        *(("--standin-profile", str(cfg.profile)) if cfg.profile is not None else ()),
        *("--brokers", bootstrap, "--input-topic", tin, "--output-topic", tout, "--dlq-topic", tdlq),
        *("--group-id", tag, "--max-wait-ms", str(cfg.max_wait_ms)),
        *(("--exactly-once", "--transactional-id-prefix", tag) if cfg.exactly_once else ()),
        *cfg.worker_flags,
    ]
    worker = WorkerProc(args, workdir / f"{cfg.label}.log", module="ops.load.standin_engine", name=cfg.label)
    out_topics = [tout, tdlq]
    result: dict[str, Any] = {
        "config": cfg.label,
        "partitions": cfg.partitions,
        "exactly_once": cfg.exactly_once,
        "topics": {"in": tin, "out": tout, "dlq": tdlq},
    }
    async with Watcher(bootstrap, out_topics, parts, cfg.exactly_once) as watch:
        worker.start()
        cpu0 = None
        t_first = None
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            n = await watch.total()
            if cpu0 is None and n > 0:
                cpu0, t_first, n_first = _cpu_s(worker.pid), time.monotonic(), n
            if n >= cfg.backlog:
                break
            if not worker.alive:
                raise RuntimeError(f"worker exited:\n{worker.log_tail()}")
            await asyncio.sleep(0.1)
        cpu1, t_last = _cpu_s(worker.pid), time.monotonic()
        if cpu0 is not None and cpu1 is not None and t_first is not None and n > n_first:
            result["worker_cpu_ms_per_event"] = round((cpu1 - cpu0) * 1000 / (n - n_first), 3)
            result["worker_cores_busy"] = round((cpu1 - cpu0) / (t_last - t_first), 2)
        # Latency, with the worker caught up and idle.
        await asyncio.sleep(2.0)
        seen: dict[str, dict[tuple[int, int], float]] = {"in": {}, "out": {}}
        stop = asyncio.Event()
        reader = asyncio.create_task(_arrivals(bootstrap, {tin: cfg.partitions, tout: 1}, stop, seen))
        await asyncio.sleep(1.0)
        sent, paced = await _paced_send(
            bootstrap, tin, mix, cfg.backlog, cfg.latency_events, cfg.latency_rate
        )
        wait_until = time.monotonic() + 120
        while len([k for k in sent if k in seen["out"]]) < len(sent) and time.monotonic() < wait_until:
            await asyncio.sleep(0.2)
        stop.set()
        await reader
    rc = await asyncio.to_thread(worker.stop)
    cost_s = cfg.cost_us / 1e6
    added = [seen["out"][k] - t - cost_s for k, t in sent.items() if k in seen["out"]]
    hop = [seen["in"][k] - t for k, t in sent.items() if k in seen["in"]]
    stamps, invalid = await _outcomes(bootstrap, tout, tdlq)
    # Backlog throughput: the first `backlog` outcomes' Kafka timestamps (the latency phase after).
    first_n = stamps[: cfg.backlog]
    span_s = (first_n[-1] - first_n[0]) / 1000.0 if len(first_n) > 1 else None
    checker = Checker(bootstrap, tin, tout, tdlq, [*backlog.produced, *paced])
    async with checker:
        rep = await checker.wait_complete(60, cfg.backlog + cfg.latency_events)
    summ = rep.summary()
    result.update(
        {
            "cost_us": cfg.cost_us,
            "max_wait_ms": cfg.max_wait_ms,
            "backlog": cfg.backlog,
            "events_per_s": round((len(first_n) - 1) / span_s, 1) if span_s else None,
            "backlog_span_s": span_s,
            "latency_events": len(sent),
            "latency_rate": cfg.latency_rate,
            "latency_seen": len(added),
            "added_ms": {"p50": _ms(added, 50), "p99": _ms(added, 99), "max": _ms(added, 100)},
            "input_hop_ms": {"p50": _ms(hop, 50), "p99": _ms(hop, 99)},
            "outcomes_read": len(stamps),
            "records_invalid": invalid,
            "check": {
                k: summ[k]
                for k in (
                    "ok",
                    "inputs",
                    "records",
                    "dead_letters",
                    "lost",
                    "conflicting",
                    "divergent",
                    "duplicates",
                    "wrong",
                    "orphans",
                )
            },
            "worker_rc": rc,
            "worker_peak_rss_mib": round(worker.peak_rss_kib / 1024, 1),
            "load1_before": round(load1_before, 2),
            "load1_after": round(os.getloadavg()[0], 2),
        }
    )
    if cfg.profile is not None and cfg.profile.is_file():
        result["profile_top"] = _profile_top(cfg.profile)
    return result


async def main_async(a: argparse.Namespace) -> list[dict[str, Any]]:
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="bench-pipeline-"))
    workdir.mkdir(parents=True, exist_ok=True)
    kafka = LocalKafka(workdir / "kafka")
    bootstrap = await asyncio.to_thread(kafka.start)
    results = []
    try:
        for parts in [int(x) for x in a.partitions.split(",")]:
            for mode in a.modes.split(","):
                cfg = BenchConfig(
                    partitions=parts,
                    exactly_once=MODES[mode],
                    cost_us=a.cost_us,
                    backlog=a.backlog,
                    latency_events=a.latency_events,
                    latency_rate=a.latency_rate,
                    max_wait_ms=a.max_wait_ms,
                    worker_flags=a.worker_flag,
                    profile=None if a.profile is None else a.profile / f"{parts}p-{mode}.prof",
                )
                if cfg.profile is not None:
                    cfg.profile.parent.mkdir(parents=True, exist_ok=True)
                r = await run_config(bootstrap, cfg, workdir)
                results.append(r)
                sys.stdout.write(orjson.dumps(r).decode() + "\n")
                sys.stdout.flush()
    finally:
        await asyncio.to_thread(kafka.stop)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--partitions", default="1,4", help="input partition counts, comma separated")
    p.add_argument("--modes", default="alo,eos", help="alo (at-least-once), eos (exactly-once)")
    p.add_argument("--cost-us", type=float, default=0.0, help="the engine stand-in's declared cost per event")
    p.add_argument("--backlog", type=int, default=10_000, help="events of the throughput backlog")
    p.add_argument("--latency-events", type=int, default=2_000)
    p.add_argument("--latency-rate", type=float, default=100.0, help="events/s of the paced latency load")
    p.add_argument("--max-wait-ms", type=float, default=0.0, help="the worker's batching window")
    p.add_argument("--worker-flag", action="append", default=[], help="extra `prism run` flag (repeatable)")
    p.add_argument("--profile", type=Path, default=None, help="directory for the workers' cProfile stats")
    p.add_argument("--workdir", type=Path, default=None, help="broker data and worker logs (default: temp)")
    p.add_argument("--out", type=Path, default=None, help="write all results (JSON) here")
    a = p.parse_args(argv)
    from prism_pipeline.logs import configure_logging

    configure_logging("WARNING", None)
    results = asyncio.run(main_async(a))
    if a.out is not None:
        a.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    ok = all(r["check"]["ok"] and r["records_invalid"] == 0 and r["check"]["lost"] == 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
