"""Benchmark harness: `prism backfill` over 1, 2, 4... processes, one input, merged output checked.

    python -m ops.bench.bench_backfill --model tiny.gguf --events 400 --processes 1 2 4 \\
        [--precision int8] [--stand-in-ms 50] --work /tmp/bench-backfill

Default mode runs the real command, `python -m prism_pipeline.cli backfill ... --processes N`,
and reports its wall time (process starts and engine loads included), the summed decide rate of
its shards (their `backfill.done` log lines: events over each shard's own run, loads excluded),
the machine's load average sampled every second meanwhile, and whether the merged output is the
1-process output byte for byte.

`--stand-in-ms MS` (a benchmark harness mode, never a default anywhere): each shard's engine
first sleeps MS per event (`ops.load.slow_worker.SlowEngine`, the declared-cost idea), standing
in for an engine whose cost is not this machine's CPU (one accelerator per process). The shards
then run here as `python -m ops.bench.bench_backfill --shard K/N ...` children calling the same
`run_backfill(shard=...)` and `merge_shards` the CLI does; the figure shows how the sharding
scales when the engine, not the host's two cores, is the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parents[2]


def write_input(path: Path, n: int) -> None:
    from prism_pipeline.synth import generate

    # The labelled lines less their labels: the events the pipeline takes.
    drop = ("labels", "ambiguous", "family")
    events = ({k: v for k, v in e.items() if k not in drop} for e in generate(n, seed=23))
    path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))


class LoadSampler:
    """The 1-minute load average, sampled every second while a run goes."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.samples.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


GATE, THOUGHT_BUDGET = 0.0, 3  # as the tests: AutoThink only where an event asks, and short


def _engine_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--model", str(args.model), "--precision", args.precision, "--chunk-events", str(args.chunk_events),
        "--gate", str(GATE), "--thought-budget", str(THOUGHT_BUDGET),
    ]  # fmt: skip


def run_cli(args: argparse.Namespace, src: Path, out: Path, n: int) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "prism_pipeline.cli", "--log-json", "backfill", str(src), "-o", str(out),
        *_engine_flags(args), "--processes", str(n), "--no-progress",
    ]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise SystemExit(f"backfill --processes {n} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rates = []
    for line in done.stderr.splitlines():
        if '"backfill.done"' in line:
            rates.append(orjson.loads(line)["events_per_s"])
    return {"wall_s": wall, "decide_events_per_s": sum(rates), "shard_events_per_s": rates}


def run_stand_in(args: argparse.Namespace, src: Path, out: Path, n: int) -> dict[str, Any]:
    from prism_pipeline.offline.shards import merge_shards

    base = [sys.executable, "-m", "ops.bench.bench_backfill", "--model", str(args.model)]
    base += ["--precision", args.precision, "--chunk-events", str(args.chunk_events)]
    base += ["--stand-in-ms", str(args.stand_in_ms), "--input", str(src), "--output", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // n))}
    t0 = time.monotonic()
    procs = [
        subprocess.Popen([*base, "--shard", f"{k}/{n}"], cwd=REPO, env=env, stdout=subprocess.PIPE)
        for k in range(1, n + 1)
    ]
    # The rate is a shard's last stdout line (its logs go to stdout before it).
    rates = [float(p.communicate()[0].decode().strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a stand-in shard failed: {[p.returncode for p in procs]}")
    merge_shards(out, out.with_name(out.name + ".dlq.jsonl"), out.with_name(out.name + ".checkpoint"), n)
    return {"wall_s": time.monotonic() - t0, "decide_events_per_s": sum(rates), "shard_events_per_s": rates}


def shard_main(args: argparse.Namespace) -> None:
    """One stand-in shard: the real engine behind a declared per-event sleep, one run_backfill."""
    from ops.load.slow_worker import SlowEngine
    from prism_pipeline.core.engine_setup import EngineSettings, load_engine
    from prism_pipeline.offline.backfill import BackfillOptions, run_backfill
    from prism_pipeline.offline.shards import Shard
    from prism_pipeline.offline.sources import FileSource

    k, n = (int(x) for x in args.shard.split("/"))
    settings = EngineSettings(
        model=args.model, precision=args.precision, gate=GATE, thought_budget=THOUGHT_BUDGET
    )
    engine = SlowEngine(load_engine(settings), args.stand_in_ms / 1e3)
    out = Path(args.output)
    summary = asyncio.run(
        run_backfill(
            engine,  # type: ignore[arg-type]
            FileSource([Path(args.input)]),
            output=out,
            dlq=out.with_name(out.name + ".dlq.jsonl"),
            checkpoint=out.with_name(out.name + ".checkpoint"),
            options=BackfillOptions(chunk_events=args.chunk_events),
            shard=Shard(k, n),
        )
    )
    sys.stdout.write(f"{summary.events_per_s}\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--precision", default="int8")
    p.add_argument("--events", type=int, default=400)
    p.add_argument("--chunk-events", type=int, default=16)
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--stand-in-ms", type=float, default=None, help="harness only: declared cost per event")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-backfill"))
    p.add_argument("--shard", help=argparse.SUPPRESS)
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.shard:
        shard_main(args)
        return 0
    from prism_pipeline.logs import configure_logging

    configure_logging("WARNING", True)
    args.work.mkdir(parents=True, exist_ok=True)
    src = args.work / "events.jsonl"
    write_input(src, args.events)
    first: bytes | None = None
    for n in args.processes:
        out = args.work / f"records-{n}p-{time.time_ns()}.jsonl"
        with LoadSampler() as load:
            res = (run_stand_in if args.stand_in_ms else run_cli)(args, src, out, n)
        data = out.read_bytes() + b"\0" + out.with_name(out.name + ".dlq.jsonl").read_bytes()
        first = data if first is None else first
        row = {
            "processes": n,
            "events": args.events,
            "mode": f"stand-in {args.stand_in_ms} ms/event" if args.stand_in_ms else "real engine",
            "precision": args.precision,
            **res,
            "events_per_s_wall": args.events / res["wall_s"],
            "load_avg_1m": {
                "start": load.samples[0],
                "max": max(load.samples),
                "mean": round(sum(load.samples) / len(load.samples), 2),
            },
            "records": out.read_bytes().count(b"\n"),
            "same_bytes_as_first": data == first,  # records and dead letters
        }
        sys.stdout.write(orjson.dumps(row).decode() + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
