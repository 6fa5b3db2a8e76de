"""`prism backfill`: the flags and the terminal output."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from prism_pipeline.cli.engine_flags import add_engine_flags, engine_settings, positive_int
from prism_pipeline.offline.backfill import BackfillOptions, BackfillSummary, run_backfill
from prism_pipeline.offline.checkpoint import read_checkpoint
from prism_pipeline.offline.errors import BackfillError, OfflineError
from prism_pipeline.offline.shards import Shard, merge_shards, shard_states, shards
from prism_pipeline.offline.sources import FileSource, TopicSource
from schemas.systemone import Limits


def render_summary(s: BackfillSummary, output: str, dlq: str) -> str:
    if s.already_complete:
        head = f"backfill already complete (checkpoint): {s.events} events"
    else:
        head = (
            f"backfill: {s.events} events ({s.events_this_run} in this run"
            + (f", resumed after {s.resumed_at}" if s.resumed_at else "")
            + f") in {s.seconds:.1f} s: {s.events_per_s:.2f} events/s"
        )
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s.dead_letter_reasons.items()))
    return (
        f"{head}\n"
        f"  {s.records} records -> {output}\n"
        f"  {s.dead_letters} dead letters -> {dlq}{' (' + reasons + ')' if reasons else ''}\n"
        f"  {s.questions} questions, AutoThink on {s.thought_questions} ({100 * s.autothink_rate:.1f}%)\n"
    )


def _shard_arg(text: str) -> Shard:
    try:
        k, n = (int(x) for x in text.split("/"))
        return Shard(k, n)
    except (ValueError, BackfillError):
        raise argparse.ArgumentTypeError(f"not K/N with 1 <= K <= N: {text!r}") from None


_PARSER: list[argparse.ArgumentParser] = []  # the backfill parser, to rebuild a shard's command line


def _child_argv(args: argparse.Namespace, shard: Shard, ranges: list[list[int]] | None) -> list[str]:
    """The command line of one shard: this command's own flags (those not at their defaults),
    less --processes, plus --shard (and the topic range the parent fixed, so all shards read the
    same events even while the topic grows)."""
    argv = [sys.executable, "-m", "prism_pipeline.cli", "--log-level", args.log_level]
    argv += ["--log-json"] if args.log_json else []
    argv.append("backfill")
    positional: list[str] = []
    for action in _PARSER[0]._actions:
        if action.dest in ("help", "processes", "shard", "input_ranges", "func", "no_progress"):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        if not action.option_strings:
            positional += [str(v) for v in value]
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            argv.append(flag)
        elif isinstance(value, list):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    argv += ["--no-progress", "--shard", f"{shard.number}/{shard.count}"]
    if ranges is not None:
        argv += ["--input-ranges", orjson.dumps(ranges).decode()]
    return [*argv, "--", *positional]


def _run_processes(
    args: argparse.Namespace,
    source: FileSource | TopicSource,
    output: Path | None,
    dlq: Path,
    checkpoint: Path,
) -> int:
    """`--processes N`: run the N shards as child processes, wait for all, merge (shards.py).

    A shard that dies does not stop the others (their work is kept); the command then exits 1
    naming it, and rerunning it resumes every unfinished shard from its own checkpoint. Each
    shard gets cores/N torch threads (OMP_NUM_THREADS, unless set) so N engines do not
    oversubscribe the machine."""
    n = args.processes
    merged = read_checkpoint(checkpoint)
    if merged is not None and merged["job"].get("processes") != n:
        sys.stderr.write(
            f"prism backfill: checkpoint {checkpoint} belongs to a job with "
            f"{merged['job'].get('processes', 1)} process(es), not {n}; delete it to start over\n"
        )
        return 2
    states = shard_states(checkpoint, n)
    if merged is None and not any(states) and not args.overwrite:
        for target in (output, dlq):
            if target is not None and target.exists() and target.stat().st_size:
                sys.stderr.write(
                    f"prism backfill: {target} exists and there is no checkpoint; pass --overwrite\n"
                )
                return 2
    ranges = None
    if isinstance(source, TopicSource):
        fixed = next((st["job"]["input"]["ranges"] for st in states if st), None)
        asyncio.run(source.resolve(fixed))
        ranges = source.describe()["ranges"]
    before = sum(st["counters"]["events"] for st in states if st)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // n)))
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(_child_argv(args, s, ranges), env=env, stdout=subprocess.DEVNULL) for s in shards(n)
    ]

    def forward(signum: int, _frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    failed = [(s, c) for s, c in zip(shards(n), codes, strict=True) if c != 0]
    if failed:
        what = ", ".join(f"{s.number}/{n} (exit {c})" for s, c in failed)
        if all(c == 2 for _, c in failed):  # each wrote why (a setting, a file, another job's checkpoint)
            sys.stderr.write(f"prism backfill: shard(s) {what} could not run: see their errors above\n")
            return 2
        sys.stderr.write(
            f"prism backfill: shard(s) {what} did not finish; the others' work is kept: "
            "rerun the same command to resume\n"
        )
        return 1
    try:
        state, already = merge_shards(output, dlq, checkpoint, n)
    except BackfillError as e:
        sys.stderr.write(f"prism backfill: {e}\n")
        return 2
    summary = BackfillSummary.from_state(state)
    summary.resumed_at = summary.events if already else before
    summary.already_complete = already
    summary.seconds = time.monotonic() - t0
    where = str(output or f"topic {args.output_topic}")
    sys.stdout.write(render_summary(summary, where, str(dlq)).replace("\n", f" ({n} processes)\n", 1))
    return 0


def _cmd_backfill(args: argparse.Namespace) -> int:
    from prism_pipeline.core.engine_setup import ConfigError, load_engine

    if args.processes > 1 and args.shard is not None:
        sys.stderr.write("prism backfill: --processes and --shard exclude each other\n")
        return 2
    if bool(args.input) == bool(args.input_topic):
        sys.stderr.write("prism backfill: give input files or --input-topic (one of them)\n")
        return 2
    if bool(args.output) == bool(args.output_topic):
        sys.stderr.write("prism backfill: give --output FILE or --output-topic TOPIC (one of them)\n")
        return 2
    output = Path(args.output) if args.output else None
    if output is None and (args.checkpoint is None or args.dlq is None):
        sys.stderr.write("prism backfill: with --output-topic, --checkpoint and --dlq are required\n")
        return 2
    base = output or Path("backfill")
    checkpoint = Path(args.checkpoint) if args.checkpoint else base.with_name(base.name + ".checkpoint")
    dlq = Path(args.dlq) if args.dlq else base.with_name(base.name + ".dlq.jsonl")
    try:
        settings = engine_settings(args)
    except ValueError as e:
        sys.stderr.write(f"prism backfill: invalid settings: {e}\n")
        return 2
    source: FileSource | TopicSource
    try:
        if args.input:
            source = FileSource([Path(p) for p in args.input])
        else:
            ranges = orjson.loads(args.input_ranges) if args.input_ranges else None
            source = TopicSource(
                args.brokers, args.input_topic, args.partition, args.from_offset, args.to_offset, ranges
            )
        if args.processes > 1:
            return _run_processes(args, source, output, dlq, checkpoint)
        engine = load_engine(settings)
    except (OfflineError, ConfigError) as e:
        sys.stderr.write(f"prism backfill: {e}\n")
        return 2
    options = BackfillOptions(
        chunk_events=args.chunk_events,
        batch_tokens=args.batch_tokens,
        max_batch_events=args.max_batch_events,
        seed_policy=args.seed_policy,
        fixed_seed=args.fixed_seed,
        limits=Limits(max_questions=args.max_questions, max_state_chars=args.max_state_chars),
        overwrite=args.overwrite,
        max_gate=args.max_gate,
    )
    tty = sys.stderr.isatty() and not args.no_progress
    try:
        summary = asyncio.run(
            run_backfill(
                engine,
                source,
                output=output,
                output_topic=(args.brokers, args.output_topic) if args.output_topic else None,
                dlq=dlq,
                checkpoint=checkpoint,
                options=options,
                progress_write=(lambda s: (sys.stderr.write(s), sys.stderr.flush())) if tty else None,
                shard=args.shard,
            )
        )
    except OfflineError as e:  # BackfillError, or a Kafka range that cannot be read
        sys.stderr.write(f"prism backfill: {e}\n")
        return 2
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()  # tensor parallel: stops the follower ranks
    sys.stdout.write(render_summary(summary, str(output or f"topic {args.output_topic}"), str(dlq)))
    return 0


def add_backfill(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "backfill",
        help="decide events from JSONL files or a topic range offline (resumable)",
        description=(
            "Decide every event of JSONL files (plain or .gz) or a topic range and write the records to "
            "JSONL (plain or .gz) or a topic. Throughput-first batching; a checkpoint makes a killed job "
            "resumable with no gaps or duplicates: rerun the same command. --processes N splits the "
            "job over N processes (each decides every N-th chunk, resumable from its own checkpoint) "
            "and merges their chunks, in order, into the one output a single process writes."
        ),
    )
    _PARSER[:] = [p]
    p.add_argument("input", nargs="*", help="JSONL event files, in order (.gz: gzip)")
    p.add_argument("--input-topic", help="read a topic range instead of files")
    p.add_argument("--partition", type=int, action="append", help="input partition (repeatable; default all)")
    p.add_argument("--from-offset", type=int, help="first input offset (inclusive)")
    p.add_argument("--to-offset", type=int, help="input offsets before this (default: the end at job start)")
    p.add_argument("--output", "-o", help="records JSONL file (.gz: gzip)")
    p.add_argument("--output-topic", help="publish records to this topic instead")
    p.add_argument("--dlq", help="dead-letter JSONL file (default OUTPUT.dlq.jsonl)")
    p.add_argument("--checkpoint", help="checkpoint file (default OUTPUT.checkpoint)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace existing output when there is no checkpoint"
    )
    p.add_argument("--brokers", default="localhost:9092", help="Kafka bootstrap servers (topic input/output)")
    add_engine_flags(p, model_help="GGUF model file")
    p.add_argument(
        "--max-gate", type=float, default=None, help="highest gate an event may ask for (default any)"
    )
    p.add_argument("--seed-policy", default="event", choices=["event", "id", "fixed"])
    p.add_argument("--fixed-seed", type=int, default=0)
    p.add_argument("--chunk-events", type=int, default=256, help="events per checkpoint (default 256)")
    p.add_argument("--batch-tokens", type=int, default=32768, help="token budget of one engine call")
    p.add_argument("--max-batch-events", type=int, default=256, help="events per engine call (default 256)")
    p.add_argument("--max-questions", type=int, default=64)
    p.add_argument("--max-state-chars", type=int, default=1_000_000)
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        metavar="N",
        help=(
            "run N backfill processes, each with cores/N threads, and merge their output (default 1). "
            "A killed one: rerun the same command; finished shards are kept"
        ),
    )
    # What --processes gives each of its shard processes: which shard, and the topic range it fixed.
    p.add_argument("--shard", type=_shard_arg, metavar="K/N", help=argparse.SUPPRESS)
    p.add_argument("--input-ranges", metavar="JSON", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_backfill)
