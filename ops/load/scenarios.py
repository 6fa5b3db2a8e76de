"""Scripted, repeatable fault scenarios: load in, faults injected, every input offset reconciled.

Each scenario creates fresh topics, runs real `prism run` worker processes against a real local
broker, drives load with `ops.load.generate`, injects its fault, waits until every input offset
has an outcome, stops the workers gracefully and returns the checker's report.

    python -m ops.load.scenarios worker_kill --model m.gguf [--brokers 127.0.0.1:PORT] [--events 200]
    python -m ops.load.scenarios soak --model small.gguf --duration 600 --rate 6 \
        --faults kill@180,bounce@360 --out soak.json

    python -m ops.load.scenarios leader_kill --model m.gguf --target output [--exactly-once]
    python -m ops.load.scenarios rolling_restart --model m.gguf --rate 8 --events 300
    python -m ops.load.scenarios scale --model m.gguf --phases 1,2,4,2 --phase-s 30 --engine-delay-ms 400
    python -m ops.load.scenarios saturation_soak --duration 1860 --rate 55 --standin-cost-us 20000 \
        --saturation-faults kill@300,leader@500,join@700,leave@1300,kill@1500 --timeout 1500

Scenarios: worker_kill, broker_restart, rebalance, poison_burst, slow_engine, hostile, soak, and on a
3-node replicated cluster (`ops/load/cluster.py`; topics with replication factor 3 and
min.insync.replicas 2) leader_kill, rolling_restart, scale and saturation_soak. broker_restart, soak and the
cluster scenarios start their own broker or cluster; the others use --brokers or start one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import orjson
import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError
from prometheus_client.parser import text_string_to_metric_families

from ops.load.check import Checker, CheckReport
from ops.load.cluster import LocalCluster
from ops.load.events import EventMix, Message, control_event, hostile_cases
from ops.load.generate import MAX_MESSAGE_BYTES, LoadReport, generate, require_loopback
from ops.load.procs import BounceableBroker, WorkerProc, rss_kib
from prism_pipeline.local_kafka import LocalKafka

log = structlog.get_logger(__name__)


@dataclass
class ScenarioConfig:
    model: Path | None  # None: the workers need none (saturation_soak's engine stand-in)
    workdir: Path
    events: int = 120
    producers: int = 2
    rate: float | None = None  # total messages/s; None: unpaced
    partitions: int = 4
    poison_fraction: float = 0.05
    precision: str = "int8"  # batch invariant: redecided events give byte-identical records
    thought_budget: int = 3
    worker_args: list[str] = field(default_factory=list)
    timeout_s: float = 180.0  # longest wait for all outcomes after the load ends
    seed: int = 0
    exactly_once: bool = False  # workers run --exactly-once (the checker reads read_committed)


@dataclass
class ScenarioResult:
    name: str
    check: CheckReport
    load: LoadReport
    peak_rss_mib: float
    worker_starts: int
    worker_exits: dict[str, int | None]  # unexpected exits seen while running (name -> rc)
    notes: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "scenario": self.name,
            "check": self.check.summary(),
            "load": self.load.summary(),
            "peak_worker_rss_mib": round(self.peak_rss_mib, 1),
            "worker_starts": self.worker_starts,
            "worker_exits": self.worker_exits,
            "notes": self.notes,
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def create_topics(bootstrap: str, topics: dict[str, int], replicas: int = 1) -> None:
    """Create topics that take the hostile sizes (10 MB events, their dead letters); on a cluster
    `replicas` copies each, of which min(2, replicas) must hold a write before it is acknowledged."""
    configs = {"max.message.bytes": str(MAX_MESSAGE_BYTES)}
    if replicas > 1:
        configs["min.insync.replicas"] = str(min(2, replicas))
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(t, n, replicas, topic_configs=configs) for t, n in topics.items()]
        )
    finally:
        await admin.close()


def scrape(port: int) -> dict[str, float]:
    """A worker's Prometheus metrics, summed over labels: {sample name: value}."""
    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Pipeline:
    """Topics, workers and a checker for one scenario run."""

    def __init__(self, cfg: ScenarioConfig, bootstrap: str, name: str, replicas: int = 1) -> None:
        require_loopback(bootstrap)
        self.cfg = cfg
        self.replicas = replicas
        self.bootstrap = bootstrap
        self.name = name
        tag = f"{name}.{uuid.uuid4().hex[:8]}"
        self.input_topic = f"load.{tag}.in"
        self.output_topic = f"load.{tag}.out"
        self.dlq_topic = f"load.{tag}.dlq"
        self.group = f"load.{tag}"
        self.workers: list[WorkerProc] = []
        self.checker = Checker(bootstrap, self.input_topic, self.output_topic, self.dlq_topic)
        self.exits: dict[str, int | None] = {}
        cfg.workdir.mkdir(parents=True, exist_ok=True)

    async def __aenter__(self) -> Pipeline:
        await create_topics(
            self.bootstrap,
            {self.input_topic: self.cfg.partitions, self.output_topic: 1, self.dlq_topic: 1},
            self.replicas,
        )
        await self.checker.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self.workers:
            if w.alive:
                await asyncio.to_thread(w.stop)
        await self.checker.__aexit__(*exc)

    def worker_args(self, extra: list[str] | None = None) -> list[str]:
        c = self.cfg
        return [
            *(("--model", str(c.model)) if c.model is not None else ()),
            *("--device", "cpu", "--precision", c.precision),
            *("--gate", "0.0", "--thought-budget", str(c.thought_budget)),
            *("--brokers", self.bootstrap, "--input-topic", self.input_topic),
            *("--output-topic", self.output_topic, "--dlq-topic", self.dlq_topic, "--group-id", self.group),
            *("--session-timeout-ms", "6000", "--max-wait-ms", "20"),
            *(("--exactly-once", "--transactional-id-prefix", self.group) if c.exactly_once else ()),
            *c.worker_args,
            *(extra or []),
        ]

    def worker(
        self, name: str, extra: list[str] | None = None, module: str = "prism_pipeline.cli"
    ) -> WorkerProc:
        w = WorkerProc(
            self.worker_args(extra), self.cfg.workdir / f"{self.name}.{name}.log", module=module, name=name
        )
        self.workers.append(w)
        return w.start()

    def watch(self) -> None:
        """Note workers that exited without being told to (a crash is a finding)."""
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None and w.proc.poll() is not None:
                self.exits[w.name] = w.proc.returncode
                log.warning("load.worker_died", name=w.name, rc=w.proc.returncode, log=w.log_tail(1500))

    @property
    def topics(self) -> list[str]:
        return [self.input_topic, self.output_topic, self.dlq_topic]

    async def update(self) -> None:
        """Read what arrived; a read that fails while a node is down is retried at the next call."""
        try:
            await self.checker.update()
        except KafkaError as e:
            log.warning("load.check_read_retry", error=f"{type(e).__name__}: {e}")
        self.watch()

    async def outcomes(self) -> int:
        await self.update()
        r = self.checker.report()
        return r.inputs - len(r.lost)

    async def wait_inputs(self, n: int, timeout_s: float) -> int:
        """Until the input topic holds at least `n` messages (the load has produced them)."""
        deadline = time.monotonic() + timeout_s
        got = 0
        while time.monotonic() < deadline:
            await self.update()
            got = self.checker.report().inputs
            if got >= n:
                break
            await asyncio.sleep(0.3)
        return got

    async def wait_outcomes(self, n: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        got = 0
        while time.monotonic() < deadline:
            got = await self.outcomes()
            if got >= n:
                break
            await asyncio.sleep(0.3)
        return got

    async def finish(self, load: LoadReport, notes: dict[str, Any] | None = None) -> ScenarioResult:
        """Wait for every produced offset's outcome, stop the workers, settle, report."""
        self.checker.set_manifest(load.produced)
        deadline = time.monotonic() + self.cfg.timeout_s
        while time.monotonic() < deadline:
            await self.update()
            rep = self.checker.report()
            if rep.complete and rep.inputs >= len(load.produced):
                break
            await asyncio.sleep(0.5)
        for w in self.workers:
            if w.alive:
                rc = await asyncio.to_thread(w.stop)
                if rc != 0:
                    self.exits[f"{w.name}.stop"] = rc
                    log.warning("load.worker_stop_failed", name=w.name, rc=rc, log=w.log_tail(6000))
        await asyncio.sleep(1.0)  # late duplicates from the drain
        await self.update()
        notes = {**(notes or {}), "topics": [self.input_topic, self.output_topic, self.dlq_topic]}
        return ScenarioResult(
            self.name,
            self.checker.report(),
            load,
            max((w.peak_rss_kib for w in self.workers), default=0) / 1024.0,
            sum(w.starts for w in self.workers),
            self.exits,
            notes,
        )


def _mix(cfg: ScenarioConfig, name: str) -> Callable[[int], Message]:
    return EventMix(f"{name}-{uuid.uuid4().hex[:6]}", cfg.poison_fraction, cfg.seed).message


async def _load(
    cfg: ScenarioConfig, bootstrap: str, topic: str, make: Callable[[int], Message]
) -> LoadReport:
    return await generate(
        bootstrap, topic, count=cfg.events, producers=cfg.producers, rate=cfg.rate, messages=make
    )


@contextlib.asynccontextmanager
async def _broker(bootstrap: str | None, workdir: Path) -> AsyncIterator[str]:
    if bootstrap is not None:
        yield bootstrap
        return
    kafka = LocalKafka(workdir / "kafka")
    await asyncio.to_thread(kafka.start)
    try:
        yield kafka.bootstrap
    finally:
        await asyncio.to_thread(kafka.stop)


# ---- the scenarios --------------------------------------------------------------------------------


async def _part(
    cfg: ScenarioConfig, bootstrap: str, topic: str, make: Callable[[int], Message], lo: int, hi: int
) -> LoadReport:
    """Messages lo .. hi - 1 of the mix `make`."""

    def shifted(i: int) -> Message:
        return make(lo + i)

    return await generate(
        bootstrap, topic, count=hi - lo, producers=cfg.producers, rate=cfg.rate, messages=shifted
    )


def _joined(first: LoadReport, second: LoadReport) -> LoadReport:
    retries = first.send_retries + second.send_retries
    return LoadReport(first.produced + second.produced, first.seconds + second.seconds, retries)


async def worker_kill(cfg: ScenarioConfig, bootstrap: str) -> ScenarioResult:
    """SIGKILL the only worker once a third of the outcomes exist, restart it, finish the load.

    The second half of the load is produced only after the kill, so the kill lands mid-load
    however fast the worker decides the first half."""
    async with Pipeline(cfg, bootstrap, "worker_kill") as p:
        # Rare commits: what the killed worker published after its last commit is decided again.
        w = p.worker("w", ["--commit-interval-ms", "2000"])
        make, half = _mix(cfg, "kill"), cfg.events // 2
        first = await _part(cfg, bootstrap, p.input_topic, make, 0, half)
        seen = await p.wait_outcomes(cfg.events // 3, cfg.timeout_s)
        await asyncio.to_thread(w.kill)
        w.start()
        second = await _part(cfg, bootstrap, p.input_topic, make, half, cfg.events)
        return await p.finish(_joined(first, second), {"outcomes_at_kill": seen})


async def rebalance(cfg: ScenarioConfig, bootstrap: str) -> ScenarioResult:
    """Two workers share the group; one leaves (SIGTERM) mid-load and the other takes over.

    As in `worker_kill`, the second half of the load is produced after the leave."""
    async with Pipeline(cfg, bootstrap, "rebalance") as p:
        p.worker("a")
        b = p.worker("b")
        # The leave must hand partitions over: b holds some before the load starts. (Without
        # this wait a fast "a" could reach the third before b joined, and b's SIGTERM would land
        # during its join - another case: on 2026-12-01 such a stop hung until SIGKILL.)
        if not await asyncio.to_thread(b.wait_log, "partitions.assigned", cfg.timeout_s):
            raise RuntimeError(f"worker b did not join the group:\n{b.log_tail()}")
        make, half = _mix(cfg, "rebalance"), cfg.events // 2
        first = await _part(cfg, bootstrap, p.input_topic, make, 0, half)
        seen = await p.wait_outcomes(cfg.events // 3, cfg.timeout_s)
        rc = await asyncio.to_thread(b.stop)
        second = await _part(cfg, bootstrap, p.input_topic, make, half, cfg.events)
        return await p.finish(_joined(first, second), {"outcomes_at_leave": seen, "leaver_rc": rc})


async def poison_burst(cfg: ScenarioConfig, bootstrap: str, burst: int = 40) -> ScenarioResult:
    """Good events, then `burst` poison messages in a row, then good events again."""
    prefix = f"burst-{uuid.uuid4().hex[:6]}"
    good = EventMix(prefix, 0.0, cfg.seed)
    bad = EventMix(prefix, 1.0, cfg.seed)
    lo = max(0, (cfg.events - burst) // 2)

    def make(i: int) -> Message:
        return bad.message(i) if lo <= i < lo + burst else good.message(i)

    async with Pipeline(cfg, bootstrap, "poison_burst") as p:
        p.worker("w")
        load = await generate(
            bootstrap,
            p.input_topic,
            count=cfg.events + burst,
            producers=cfg.producers,
            rate=cfg.rate,
            messages=make,
        )
        return await p.finish(load, {"burst": burst})


async def slow_engine(
    cfg: ScenarioConfig,
    bootstrap: str,
    delay_ms: float = 100.0,
    queued: int = 2,
    batch: int = 4,
    poll: int = 8,
) -> ScenarioResult:
    """An engine slower than the input: lag grows, fetching pauses, in-flight work stays bounded.

    In-flight events (consumed, outcome not yet acknowledged) are bounded by the worker's settings:
    the engine's batch, `queued` waiting batches, one overshoot of up to a fetch (`poll` records, cut
    into batches of `batch`) past the pause threshold, and one partial batch in the batcher.
    """
    port = free_port()
    bound = (queued + 2) * batch + 2 * poll
    extra = [
        *("--max-queued-batches", str(queued), "--max-batch-events", str(batch)),
        *("--max-poll-records", str(poll), "--metrics-port", str(port)),
        "--engine-delay-ms",
        str(delay_ms),
    ]
    samples: list[dict[str, float]] = []
    async with Pipeline(cfg, bootstrap, "slow_engine") as p:
        w = p.worker("w", extra, module="ops.load.slow_worker")
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    m = await asyncio.to_thread(scrape, port)
                    m["t"] = time.monotonic()
                    m["rss_kib"] = float(w.rss_samples[-1][1]) if w.rss_samples else 0.0
                    samples.append(m)
                await asyncio.sleep(0.25)

        task = asyncio.create_task(sampler())
        load = await _load(cfg, bootstrap, p.input_topic, _mix(cfg, "slow"))
        result = await p.finish(load)
        stop.set()
        await task

    def inflight(m: dict[str, float]) -> float:
        done = m.get("prism_records_out_total", 0.0) + m.get("prism_dead_letters_total", 0.0)
        return m.get("prism_events_in_total", 0.0) - done

    result.notes = {
        "delay_ms": delay_ms,
        "inflight_bound": bound,
        "max_inflight": max((inflight(m) for m in samples), default=None),
        "max_lag": max((m.get("prism_consumer_lag", 0.0) for m in samples), default=None),
        "pauses": max((m.get("prism_backpressure_pauses_total", 0.0) for m in samples), default=None),
        "samples": len(samples),
        "rss_mib_first_last": (
            [round(samples[0]["rss_kib"] / 1024, 1), round(samples[-1]["rss_kib"] / 1024, 1)]
            if samples
            else None
        ),
    }
    return result


async def hostile(cfg: ScenarioConfig, bootstrap: str) -> ScenarioResult:
    """Hostile cases around a control event; the control is decided once alone, once among them.

    Both control messages carry the same event id, so the checker's divergent-key check compares
    their decisions (everything but the input position) byte for byte.
    """
    prefix = f"hostile-{uuid.uuid4().hex[:6]}"
    cases = hostile_cases(prefix)
    ctl = control_event(f"{prefix}-control")
    control = Message(f"{prefix}-control".encode(), ctl, "event", "record", None, "control")
    half = len(cases) // 2
    async with Pipeline(cfg, bootstrap, "hostile") as p:
        # A longer batching window, so the control shares engine batches with its neighbours.
        p.worker("w", ["--max-wait-ms", "300"])
        alone = await generate(bootstrap, p.input_topic, messages=[control])
        await p.wait_outcomes(1, cfg.timeout_s)
        mixed = await generate(bootstrap, p.input_topic, messages=[*cases[:half], control, *cases[half:]])
        load = LoadReport(alone.produced + mixed.produced, alone.seconds + mixed.seconds, mixed.send_retries)
        result = await p.finish(load, {"cases": [m.label for m in cases]})
    return result


async def broker_restart(cfg: ScenarioConfig, workdir: Path, down_s: float = 2.0) -> ScenarioResult:
    """The broker is stopped and started again (same data, same address) during the load; the
    second half of the load is produced after the restart, so the bounce lands mid-load."""
    broker = BounceableBroker(workdir / "kafka-bounce")
    bootstrap = await asyncio.to_thread(broker.start)
    try:
        async with Pipeline(cfg, bootstrap, "broker_restart") as p:
            p.worker("w")
            make, half = _mix(cfg, "bounce"), cfg.events // 2
            first = await _part(cfg, bootstrap, p.input_topic, make, 0, half)
            seen = await p.wait_outcomes(cfg.events // 3, cfg.timeout_s)
            outage = await asyncio.to_thread(broker.bounce, down_s)
            second = await _part(cfg, bootstrap, p.input_topic, make, half, cfg.events)
            notes = {"outcomes_at_bounce": seen, "outage_s": round(outage, 2)}
            return await p.finish(_joined(first, second), notes)
    finally:
        await asyncio.to_thread(broker.stop)


def _timed_load(
    cfg: ScenarioConfig, bootstrap: str, topic: str, duration_s: float, rate: float | None, name: str
) -> asyncio.Task[LoadReport]:
    """The soaks' load: `duration_s` of the event mix at `rate`, in the background."""
    return asyncio.create_task(
        generate(
            bootstrap,
            topic,
            duration_s=duration_s,
            producers=cfg.producers,
            rate=rate,
            messages=_mix(cfg, name),
        )
    )


async def soak(
    cfg: ScenarioConfig, workdir: Path, duration_s: float, faults: list[tuple[str, float]]
) -> ScenarioResult:
    """Sustained paced load for `duration_s` with faults at given seconds: kill (SIGKILL the worker,
    restart it), bounce (stop and restart the broker), leave (a second worker joins, then leaves)."""
    broker = BounceableBroker(workdir / "kafka-soak")
    bootstrap = await asyncio.to_thread(broker.start)
    done: list[dict[str, Any]] = []
    try:
        async with Pipeline(cfg, bootstrap, "soak") as p:
            w = p.worker("w")
            # Latency should measure the pipeline, not the first engine load.
            if not await asyncio.to_thread(w.wait_log, "partitions.assigned", 600):
                raise RuntimeError(f"the worker did not join its group:\n{w.log_tail()}")
            t0 = time.monotonic()
            load = _timed_load(cfg, bootstrap, p.input_topic, duration_s, cfg.rate, "soak")
            for kind, at in sorted(faults, key=lambda f: f[1]):
                while time.monotonic() - t0 < at and not load.done():
                    await p.outcomes()
                    await asyncio.sleep(1.0)
                t = round(time.monotonic() - t0, 1)
                if kind == "kill":
                    await asyncio.to_thread(w.kill)
                    w.start()
                    done.append({"fault": "kill", "at_s": t})
                elif kind == "bounce":
                    outage = await asyncio.to_thread(broker.bounce, 2.0)
                    done.append({"fault": "bounce", "at_s": t, "outage_s": round(outage, 1)})
                elif kind == "leave":
                    extra = p.worker(f"extra{len(done)}")
                    await asyncio.sleep(20)
                    await asyncio.to_thread(extra.stop)
                    done.append({"fault": "leave", "at_s": t})
                else:
                    raise ValueError(f"unknown fault {kind!r}: use kill, bounce or leave")
            return await p.finish(await load, {"faults": done, "duration_s": duration_s})
    finally:
        await asyncio.to_thread(broker.stop)


# ---- on a replicated cluster ----------------------------------------------------------------------

CLUSTER_RATE = 8.0  # messages/s of the paced load under the cluster faults, when --rate is not given


def _max_gap_s(stamps_ms: list[int], lo_s: float, hi_s: float) -> float | None:
    """The longest time without a new outcome between wall-clock times lo_s and hi_s: the last
    outcome before lo_s (or lo_s itself), every outcome in the window, then hi_s close it off.
    None when nothing was published in the window at all."""
    lo, hi = lo_s * 1000.0, hi_s * 1000.0
    inside = [t for t in stamps_ms if lo <= t <= hi]
    if not inside:
        return None
    before = [t for t in stamps_ms if t < lo]
    points = [float(before[-1]) if before else lo, *map(float, inside)]
    return round(max(b - a for a, b in zip(points, points[1:], strict=False)) / 1000.0, 2)


def _background_load(
    cfg: ScenarioConfig, bootstrap: str, topic: str, make: Callable[[int], Message]
) -> tuple[asyncio.Task[LoadReport], asyncio.Event]:
    """Paced load that runs until the returned event is set: the faults decide how long it lasts,
    so every fault lands while events keep arriving."""
    stop = asyncio.Event()
    task = asyncio.create_task(
        generate(
            bootstrap,
            topic,
            producers=cfg.producers,
            rate=cfg.rate or CLUSTER_RATE,
            messages=make,
            stop=stop,
        )
    )
    return task, stop


async def _led_by(cluster: LocalCluster, topics: list[str], node: int) -> dict[str, list[int]]:
    """{topic: partitions node leads} for the given topics."""
    out: dict[str, list[int]] = {}
    for (topic, part), d in sorted((await cluster.describe(topics)).items()):
        if d["leader"] == node:
            out.setdefault(topic, []).append(part)
    return out


async def leader_kill(cfg: ScenarioConfig, cluster: LocalCluster, target: str = "output") -> ScenarioResult:
    """SIGKILL the node leading partition 0 of the output topic (`target` "output") or of the
    input topic ("input") while paced load runs; the cluster elects new leaders from the in-sync
    replicas, the node comes back and catches up, the load goes on.

    With 4 input partitions led round-robin by 3 nodes every node leads input and, for one of them,
    output partitions, so one kill hits both; `notes["led"]` says what the victim led."""
    if target not in ("input", "output"):
        raise ValueError(f"target must be input or output, got {target!r}")
    name = f"leader_kill_{target}{'_eos' if cfg.exactly_once else ''}"
    bootstrap = cluster.bootstrap
    async with Pipeline(cfg, bootstrap, name, replicas=cluster.replication_factor) as p:
        p.worker("w", ["--commit-interval-ms", "1000"])
        load, stop = _background_load(cfg, bootstrap, p.input_topic, _mix(cfg, name))
        seen = await p.wait_outcomes(max(1, cfg.events // 3), cfg.timeout_s)
        topic = p.input_topic if target == "input" else p.output_topic
        victim = await cluster.leader(topic, 0)
        led = await _led_by(cluster, p.topics, victim)
        t_kill = time.time()
        await asyncio.to_thread(cluster.node_kill, victim)
        failover = await cluster.wait_leader(topic, 0, victim, timeout=cfg.timeout_s)
        # Progress with the node still down: outcomes for events produced after the kill.
        after = await p.wait_outcomes(seen + max(1, cfg.events // 3), cfg.timeout_s)
        t_back = time.time()
        await asyncio.to_thread(cluster.node_start, victim)
        in_sync = await cluster.wait_in_sync(p.topics, timeout=cfg.timeout_s)
        await p.wait_inputs(cfg.events, cfg.timeout_s)
        stop.set()
        result = await p.finish(
            await load,
            {
                "victim": victim,
                "led": led,
                "outcomes_at_kill": seen,
                "outcomes_before_restart": after,
                "failover_s": round(failover, 2),
                "resync_s": round(in_sync, 2),
                "exactly_once": cfg.exactly_once,
            },
        )
        result.notes["max_outcome_gap_s"] = _max_gap_s(p.checker.outcome_timestamps(), t_kill, t_back)
        return result


async def rolling_restart(cfg: ScenarioConfig, cluster: LocalCluster, down_s: float = 1.0) -> ScenarioResult:
    """Every node in turn: controlled shutdown (SIGTERM), `down_s` down, start, and the next only
    once every replica is back in sync (as an operator's rolling upgrade does), under paced load."""
    name = f"rolling_restart{'_eos' if cfg.exactly_once else ''}"
    bootstrap = cluster.bootstrap
    async with Pipeline(cfg, bootstrap, name, replicas=cluster.replication_factor) as p:
        p.worker("w", ["--commit-interval-ms", "1000"])
        load, stop = _background_load(cfg, bootstrap, p.input_topic, _mix(cfg, name))
        await p.wait_outcomes(max(1, cfg.events // 4), cfg.timeout_s)
        steps: list[dict[str, Any]] = []
        for node in sorted(await asyncio.to_thread(cluster.status)):
            before = await p.outcomes()
            t0 = time.time()
            stop_s = await asyncio.to_thread(cluster.node_stop, node)
            await asyncio.sleep(down_s)
            start_s = await asyncio.to_thread(cluster.node_start, node)
            sync_s = await cluster.wait_in_sync(p.topics, timeout=cfg.timeout_s)
            steps.append(
                {
                    "node": node,
                    "t0": t0,
                    "t1": time.time(),
                    "stop_s": round(stop_s, 2),
                    "start_s": round(start_s, 2),
                    "resync_s": round(sync_s, 2),
                    "outcomes_during": await p.outcomes() - before,
                }
            )
        await p.wait_inputs(cfg.events, cfg.timeout_s)
        stop.set()
        result = await p.finish(await load, {"exactly_once": cfg.exactly_once})
        stamps = p.checker.outcome_timestamps()
        for s in steps:
            s["max_outcome_gap_s"] = _max_gap_s(stamps, s.pop("t0"), s.pop("t1"))
        result.notes["restarts"] = steps
        return result


_REVOKE_START = "Revoking previously assigned partitions"  # aiokafka's line as a rebalance begins


def _log_events(w: WorkerProc, after: int, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The worker's JSON log lines (from byte `after`) whose event is one of `names`, and the
    revoke starts aiokafka logs (as "revoke.start"; the worker's own `partitions.revoked` comes
    once its in-flight work is done)."""
    try:
        data = w.log_path.read_bytes()[after:]
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        if not line.startswith(b"{"):
            continue
        try:
            doc = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        event = str(doc.get("event", ""))
        if event.startswith(_REVOKE_START) and "set()" not in event:
            out.append({**doc, "event": "revoke.start"})
        elif event in names:
            out.append(doc)
    return out


def _wall(doc: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(str(doc["timestamp"])).timestamp()


async def _wait_settled(
    members: list[WorkerProc],
    marks: dict[str, int],
    partitions: int,
    timeout_s: float,
    on_poll: Callable[[], Awaitable[None]],
) -> tuple[float, float | None]:
    """Until every member logged an assignment since its mark and those assignments cover each
    input partition once. Returns (the wall time of the last assignment, the first revoke's start
    or None): the rebalance as the workers saw it. `on_poll` runs at every look (the backlog top-up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        await on_poll()
        last: dict[str, dict[str, Any]] = {}
        revokes: list[float] = []
        for w in members:
            evs = _log_events(w, marks.get(w.name, 0), ("partitions.assigned", "partitions.revoked"))
            revokes += [_wall(e) for e in evs if e["event"] == "revoke.start"]
            evs = [e for e in evs if e["event"] != "revoke.start"]
            if evs and evs[-1]["event"] == "partitions.assigned":
                last[w.name] = evs[-1]
        owned = sorted(q for e in last.values() for q in e.get("partitions", []))
        if len(last) == len(members) and owned == list(range(partitions)):
            return max(_wall(e) for e in last.values()), (min(revokes) if revokes else None)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the group did not settle within {timeout_s:.0f}s: {owned} over {len(last)}")
        await asyncio.sleep(0.3)


async def scale(
    cfg: ScenarioConfig,
    cluster: LocalCluster,
    phases: tuple[int, ...] = (1, 2, 4, 2),
    phase_s: float = 10.0,
    delay_ms: float = 400.0,
) -> ScenarioResult:
    """Workers of one group scaled through `phases` (1 -> 2 -> 4 -> 2) over a backlog, measuring
    the group's throughput in each phase and the pause every membership change costs.

    The workers' engine is the tiny model behind `ops.load.slow_worker`'s declared stand-in cost
    (`delay_ms` of sleep per event), so one worker saturates at about 1000 / delay_ms events/s
    and more workers can add throughput on a machine with few cores. Small fetches and batches
    (4 records a poll, batches of 2) keep what a revoked worker must finish small.

    A phase starts when every member has its assignment; its throughput is the outcomes
    published from 1 s after that to the phase's end. A change's pause is the longest time without
    any outcome, from the change (a worker started or told to stop) to 2 s after the group settled;
    its rebalance runs from the first member's revoke to the last member's assignment. The input
    is topped up throughout so that at least `horizon_s` of the members' nominal work waits (a
    new worker's model load takes 15-60 s on a busy machine, and a backlog that ran dry meanwhile
    would read as a pause): a gap in outcomes is the group's, never a lack of input.
    """
    horizon_s = 6.0
    if cfg.partitions < max(phases):
        raise ValueError(f"{max(phases)} workers need at least as many partitions, not {cfg.partitions}")
    name = f"scale{'_eos' if cfg.exactly_once else ''}"
    # What a revoked member must finish before it rejoins is what it holds in flight: at most a
    # poll (4), one queued batch and the engine's (2 each) and a partial batch, about 10 events, so
    # a revoke takes about 10 x delay_ms. The session timeout is the worker's default (10 s, not the
    # 6 s the other scenarios use): with aiokafka's 3 s heartbeat a 6 s session expired members of a
    # 4-worker group on 2 loaded cores in turn, a rebalance storm that never settled (RESULTS.md).
    extra = [
        *("--engine-delay-ms", str(delay_ms), "--max-batch-events", "2"),
        *("--max-poll-records", "4", "--max-queued-batches", "1", "--commit-interval-ms", "500"),
        *("--session-timeout-ms", "10000"),
    ]
    per_worker = 1000.0 / delay_ms
    bootstrap = cluster.bootstrap
    mix = _mix(cfg, name)
    loads: list[LoadReport] = []
    async with Pipeline(cfg, bootstrap, name, replicas=cluster.replication_factor) as p:
        active: list[WorkerProc] = []

        async def top_up(at_least: int = 0) -> None:
            have = sum(len(r.produced) for r in loads)
            want = max(at_least - have, int(max(1, len(active)) * per_worker * horizon_s) + 8)
            lag = have - await p.outcomes()
            if lag < want:
                lo = have

                def shifted(i: int) -> Message:
                    return mix(lo + i)

                loads.append(
                    await generate(
                        bootstrap, p.input_topic, count=want - lag, producers=cfg.producers, messages=shifted
                    )
                )

        await top_up()
        spawned = 0
        marks: dict[str, int] = {}
        timeline: list[dict[str, Any]] = []
        for k in phases:
            t_change = time.time()
            marks = {w.name: w.log_size() for w in active}
            if k > len(active):
                for _ in range(k - len(active)):
                    spawned += 1
                    active.append(p.worker(f"w{spawned}", extra, module="ops.load.slow_worker"))
            elif k < len(active):
                leaving, active = active[k:], active[:k]
                marks = {w.name: w.log_size() for w in active}
                rcs = await asyncio.gather(*(asyncio.to_thread(w.stop) for w in leaving))
                for w, rc in zip(leaving, rcs, strict=True):
                    if rc != 0:
                        p.exits[f"{w.name}.stop"] = rc
            settled, first_revoke = await _wait_settled(active, marks, cfg.partitions, cfg.timeout_s, top_up)
            while time.time() < settled + phase_s:
                await top_up()
                await asyncio.sleep(min(0.5, max(0.0, settled + phase_s - time.time())))
            timeline.append(
                {
                    "workers": k,
                    "t_change": t_change,
                    "t_settled": max(settled, t_change),
                    "t_end": time.time(),
                    "rebalance_s": None if first_revoke is None else round(settled - first_revoke, 2),
                }
            )
        await top_up(cfg.events)
        await p.update()
        stamps = p.checker.outcome_timestamps()
        load = LoadReport(
            [x for r in loads for x in r.produced],
            sum(r.seconds for r in loads),
            sum(r.send_retries for r in loads),
        )
        result = await p.finish(load)
    phases_out = []
    for i, ph in enumerate(timeline):
        lo, hi = ph["t_settled"] + 1.0, ph["t_end"]
        n = sum(1 for t in stamps if lo * 1000 <= t <= hi * 1000)
        entry: dict[str, Any] = {
            "workers": ph["workers"],
            "events_per_s": round(n / (hi - lo), 2) if hi > lo else None,
            "window_s": round(hi - lo, 1),
        }
        if i > 0:  # the first phase starts the group: a cold start, not a rebalance
            entry["change"] = f"{timeline[i - 1]['workers']}->{ph['workers']}"
            entry["pause_s"] = _max_gap_s(stamps, ph["t_change"], ph["t_settled"] + 2.0)
            entry["rebalance_s"] = ph["rebalance_s"]
            entry["change_to_settled_s"] = round(ph["t_settled"] - ph["t_change"], 2)
        phases_out.append(entry)
    result.notes = {
        **result.notes,
        "phases": phases_out,
        "delay_ms": delay_ms,
        "backlog_horizon_s": horizon_s,
        "nominal_per_worker_events_per_s": per_worker,
        "exactly_once": cfg.exactly_once,
    }
    return result


SATURATION_FAULTS = "kill@300,leader@500,join@700,leave@1300,kill@1500"


def _memory_sample(p: Pipeline, cluster: LocalCluster, t0: float) -> dict[str, Any]:
    """One look at the resident memory of every live worker and broker node, and the load average."""
    workers = {w.name: rss_kib(w.pid) for w in p.workers if w.alive}
    nodes = {str(n): rss_kib(pid) for n, pid in cluster.status().items()}
    return {
        "t_s": round(time.monotonic() - t0, 1),
        "load1": round(os.getloadavg()[0], 2),
        "workers_kib": {k: v for k, v in workers.items() if v is not None},
        "brokers_kib": {k: v for k, v in nodes.items() if v is not None},
    }


def _memory_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per process: RSS (MiB) at its first and last sample, its peak, and the median of its first
    and of its last 10 samples (growth that a soak should expose), plus the load average's range."""
    series: dict[str, list[float]] = {}
    for s in samples:
        for kind in ("workers_kib", "brokers_kib"):
            for name, kib in s[kind].items():
                label = f"{'worker' if kind == 'workers_kib' else 'broker'} {name}"
                series.setdefault(label, []).append(kib / 1024.0)

    def med(xs: list[float]) -> float:
        return round(sorted(xs)[len(xs) // 2], 1)

    loads = sorted(s["load1"] for s in samples)
    return {
        "samples": len(samples),
        "load1": {"min": loads[0], "median": loads[len(loads) // 2], "max": loads[-1]} if loads else None,
        "rss_mib": {
            k: {
                "n": len(v),
                "first": round(v[0], 1),
                "last": round(v[-1], 1),
                "max": round(max(v), 1),
                "median_first10": med(v[:10]),
                "median_last10": med(v[-10:]),
            }
            for k, v in sorted(series.items())
        },
    }


def _per_minute(stamps_ms: list[int], t0_wall: float) -> list[int]:
    """Outcomes published in each minute from `t0_wall`: the soak's throughput over time."""
    out: list[int] = []
    for t in stamps_ms:
        i = int((t / 1000.0 - t0_wall) // 60)
        if i < 0:
            continue
        out.extend([0] * (i + 1 - len(out)))
        out[i] += 1
    return out


async def saturation_soak(
    cfg: ScenarioConfig,
    cluster: LocalCluster,
    duration_s: float = 1860.0,
    cost_us: float = 20_000.0,
    faults: list[tuple[str, float]] | None = None,
    sample_s: float = 10.0,
    leader_down_s: float = 30.0,
) -> ScenarioResult:
    """Paced load above what one worker sustains, for `duration_s`, on the 3-node cluster, with
    faults at given seconds; memory of every worker and broker node sampled every `sample_s`.

    The workers are `prism run` behind `ops.load.standin_engine` (a declared cost of `cost_us`
    per event: 20 ms caps one worker below 50 events/s, under the default 55/s offered, while a
    model on these CPUs would cap the run at ~5 events/s, 100,000 events in 5.5 hours). One
    worker runs throughout, so the input's lag grows and fetching pauses (saturation); faults:
    - kill: SIGKILL the first worker and start it again at once (its in-flight work is re-decided);
    - leader: SIGKILL the node leading input partition 0, keep it down `leader_down_s` under load,
      start it again and wait until every replica is in sync;
    - join: a second worker joins the group (a rebalance; the group then keeps up and drains);
    - leave: the last joined worker stops (SIGTERM; a rebalance back to one).
    In-flight work per worker is kept small (50 records a poll, batches of 16, 2 queued batches:
    about 2 s of work) so a revoke finishes well within the session timeout. The checker polls
    every 5 s with its cheap `progress` (its full report over 100,000 offsets takes a second)."""
    faults = sorted(parse_faults(SATURATION_FAULTS) if faults is None else faults, key=lambda f: f[1])
    name = f"saturation{'_eos' if cfg.exactly_once else ''}"
    rate = cfg.rate or 55.0
    extra = [
        *("--standin-cost-us", str(cost_us), "--max-poll-records", "50", "--max-batch-events", "16"),
        *("--max-queued-batches", "2", "--session-timeout-ms", "10000"),
    ]
    module = "ops.load.standin_engine"
    bootstrap = cluster.bootstrap
    samples: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    async with Pipeline(cfg, bootstrap, name, replicas=cluster.replication_factor) as p:
        base = p.worker("w1", extra, module=module)
        if not await asyncio.to_thread(base.wait_log, "partitions.assigned", 300):
            raise RuntimeError(f"the worker did not join its group:\n{base.log_tail()}")
        t0, t0_wall = time.monotonic(), time.time()
        stop_sampling = asyncio.Event()

        async def sampler() -> None:
            while not stop_sampling.is_set():
                with contextlib.suppress(Exception):  # a node mid-restart: the next look sees it
                    samples.append(await asyncio.to_thread(_memory_sample, p, cluster, t0))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop_sampling.wait(), sample_s)

        sampling = asyncio.create_task(sampler())
        load = _timed_load(cfg, bootstrap, p.input_topic, duration_s, rate, name)
        joined: list[WorkerProc] = []

        async def progress() -> tuple[int, int]:
            await p.update()
            return p.checker.progress()

        for kind, at in faults:
            while time.monotonic() - t0 < at and not load.done():
                got = await progress()
                log.info(
                    "saturation.progress", t_s=round(time.monotonic() - t0), inputs=got[0], decided=got[1]
                )
                await asyncio.sleep(min(5.0, max(0.0, t0 + at - time.monotonic())))
            inputs, decided = await progress()
            entry: dict[str, Any] = {
                "fault": kind,
                "at_s": round(time.monotonic() - t0, 1),
                "lag": inputs - decided,
            }
            entry["t_wall"] = time.time()
            if kind == "kill":
                await asyncio.to_thread(base.kill)
                base.start()
            elif kind == "leader":
                victim = await cluster.leader(p.input_topic, 0)
                entry["victim"] = victim
                entry["led"] = await _led_by(cluster, p.topics, victim)
                await asyncio.to_thread(cluster.node_kill, victim)
                entry["failover_s"] = round(
                    await cluster.wait_leader(p.input_topic, 0, victim, timeout=120), 2
                )
                await asyncio.sleep(leader_down_s)
                await asyncio.to_thread(cluster.node_start, victim)
                entry["resync_s"] = round(await cluster.wait_in_sync(p.topics, timeout=300), 2)
                entry["t_back_wall"] = time.time()
            elif kind == "join":
                joined.append(p.worker(f"j{len(joined) + 1}", extra, module=module))
            elif kind == "leave":
                if not joined:
                    raise ValueError("a leave fault needs a join before it")
                leaver = joined.pop()
                entry["leaver"] = leaver.name
                # A member told to stop while it still joins is another case (a stop during the
                # join); this fault is a member leaving: it goes once it has held partitions.
                await asyncio.to_thread(leaver.wait_log, "partitions.assigned", 300)
                entry["leaver_rc"] = await asyncio.to_thread(leaver.stop)
                if entry["leaver_rc"] != 0:
                    p.exits[f"{leaver.name}.stop"] = entry["leaver_rc"]
            else:
                raise ValueError(f"unknown fault {kind!r}: use kill, leader, join or leave")
            done.append(entry)
            log.info("saturation.fault", **{k: v for k, v in entry.items() if k != "led"})
        report = await load
        p.checker.set_manifest(report.produced)
        t_load_end = time.monotonic() - t0
        deadline = time.monotonic() + cfg.timeout_s
        while time.monotonic() < deadline:
            inputs, decided = await progress()
            log.info("saturation.drain", inputs=inputs, decided=decided, produced=len(report.produced))
            if inputs >= len(report.produced) and decided >= inputs:
                break
            await asyncio.sleep(5.0)
        t_drained = time.monotonic() - t0
        stop_sampling.set()
        await sampling
        result = await p.finish(report)
    stamps = p.checker.outcome_timestamps()
    for f in done:
        lo = f.pop("t_wall")
        hi = f.pop("t_back_wall", lo + 60.0)
        f["max_outcome_gap_s"] = _max_gap_s(stamps, lo, hi)
    (cfg.workdir / f"{name}.memory.jsonl").write_bytes(b"".join(orjson.dumps(s) + b"\n" for s in samples))
    result.notes = {
        **result.notes,
        "cost_us": cost_us,
        "rate": rate,
        "duration_s": duration_s,
        "load_end_s": round(t_load_end, 1),
        "drained_s": round(t_drained, 1),
        "faults": done,
        "outcomes_per_minute": _per_minute(stamps, t0_wall),
        "memory": _memory_summary(samples),
        "exactly_once": cfg.exactly_once,
    }
    return result


CLUSTER_SCENARIOS = ("leader_kill", "rolling_restart", "scale", "saturation_soak")


SCENARIOS = (
    "worker_kill",
    "broker_restart",
    "rebalance",
    "poison_burst",
    "slow_engine",
    "hostile",
    "soak",
    *CLUSTER_SCENARIOS,
)


def parse_faults(text: str) -> list[tuple[str, float]]:
    out = []
    for part in filter(None, (s.strip() for s in text.split(","))):
        kind, _, at = part.partition("@")
        try:
            out.append((kind, float(at)))
        except ValueError:
            raise ValueError(f"bad fault {part!r}: want KIND@SECONDS, e.g. kill@120") from None
    return out


async def _on_cluster(name: str, cfg: ScenarioConfig, cluster: LocalCluster, **kw: Any) -> ScenarioResult:
    if name == "saturation_soak":
        return await saturation_soak(
            cfg,
            cluster,
            kw.get("duration_s", 1860.0),
            kw.get("cost_us", 20_000.0),
            kw.get("saturation_faults"),
        )
    if name == "leader_kill":
        return await leader_kill(cfg, cluster, kw.get("target", "output"))
    if name == "rolling_restart":
        return await rolling_restart(cfg, cluster)
    return await scale(
        cfg,
        cluster,
        tuple(kw.get("phases", (1, 2, 4, 2))),
        kw.get("phase_s", 10.0),
        kw.get("delay_ms", 400.0),
    )


async def run_scenario(name: str, cfg: ScenarioConfig, bootstrap: str | None, **kw: Any) -> ScenarioResult:
    if name in CLUSTER_SCENARIOS:
        if kw.get("cluster") is not None:
            return await _on_cluster(name, cfg, kw["cluster"], **kw)
        cluster = LocalCluster(cfg.workdir / "cluster")
        await asyncio.to_thread(cluster.start)
        try:
            return await _on_cluster(name, cfg, cluster, **kw)
        finally:
            await asyncio.to_thread(cluster.stop)
    if name == "broker_restart":
        return await broker_restart(cfg, cfg.workdir)
    if name == "soak":
        return await soak(cfg, cfg.workdir, kw["duration_s"], kw.get("faults", []))
    fn = {
        "worker_kill": worker_kill,
        "rebalance": rebalance,
        "poison_burst": poison_burst,
        "slow_engine": slow_engine,
        "hostile": hostile,
    }.get(name)
    if fn is None:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    async with _broker(bootstrap, cfg.workdir) as b:
        return await fn(cfg, b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ops.load.scenarios", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=SCENARIOS)
    p.add_argument(
        "--model", type=Path, default=None, help="GGUF model for the workers (saturation_soak: none)"
    )
    p.add_argument("--brokers", default=None, help="loopback broker (default: start one)")
    p.add_argument("--workdir", type=Path, default=Path("load-runs"), help="worker logs, broker data")
    p.add_argument("--events", type=int, default=120)
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--rate", type=float, default=None, help="total messages/s (default: unpaced)")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--poison-fraction", type=float, default=0.05)
    p.add_argument("--precision", default="int8", choices=["int8", "fp32", "bf16"])
    p.add_argument("--duration", type=float, default=600.0, help="soak: seconds of load")
    p.add_argument(
        "--faults", default="kill@200,bounce@400", help="soak: KIND@SECONDS,... (kill, bounce, leave)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for outcomes after the load")
    p.add_argument("--exactly-once", action="store_true", help="workers run --exactly-once")
    p.add_argument(
        "--target", choices=["input", "output"], default="output", help="leader_kill: whose leader dies"
    )
    p.add_argument("--phases", default="1,2,4,2", help="scale: group sizes in turn")
    p.add_argument("--phase-s", type=float, default=10.0, help="scale: seconds each group size runs")
    p.add_argument(
        "--engine-delay-ms",
        type=float,
        default=400.0,
        help="scale: the engine stand-in's declared cost per event (ops.load.slow_worker)",
    )
    p.add_argument(
        "--standin-cost-us",
        type=float,
        default=20_000.0,
        help="saturation_soak: the engine stand-in's declared cost per event (ops.load.standin_engine)",
    )
    p.add_argument(
        "--saturation-faults",
        default=SATURATION_FAULTS,
        help="saturation_soak: KIND@SECONDS,... (kill, leader, join, leave)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the result summary (JSON) here")
    a = p.parse_args(argv)
    if a.model is None and a.scenario != "saturation_soak":
        p.error(f"{a.scenario} needs --model (only saturation_soak's engine stand-in runs without one)")
    from prism_pipeline.logs import configure_logging

    configure_logging("INFO", None)

    def _interrupt(signum: int, frame: object) -> None:
        # SIGTERM as Ctrl-C: asyncio cancels the scenario, whose finally blocks stop the workers
        # and the broker or cluster it started (the default action would leave them running).
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    cfg = ScenarioConfig(
        model=a.model,
        workdir=a.workdir.resolve(),
        events=a.events,
        producers=a.producers,
        rate=a.rate,
        partitions=a.partitions,
        poison_fraction=a.poison_fraction,
        precision=a.precision,
        timeout_s=a.timeout,
        exactly_once=a.exactly_once,
    )
    try:
        result = asyncio.run(
            run_scenario(
                a.scenario,
                cfg,
                a.brokers,
                duration_s=a.duration,
                faults=parse_faults(a.faults),
                target=a.target,
                phases=[int(x) for x in a.phases.split(",") if x.strip()],
                phase_s=a.phase_s,
                delay_ms=a.engine_delay_ms,
                cost_us=a.standin_cost_us,
                saturation_faults=parse_faults(a.saturation_faults),
            )
        )
    except ValueError as e:
        sys.stderr.write(f"scenarios: {e}\n")
        return 2
    text = orjson.dumps(result.summary(), option=orjson.OPT_INDENT_2).decode()
    if a.out is not None:
        a.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0 if result.check.ok and not result.worker_exits else 1


if __name__ == "__main__":
    sys.exit(main())
