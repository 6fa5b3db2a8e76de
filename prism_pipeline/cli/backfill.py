"""`prism backfill`: the flags and the terminal output."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from prism_pipeline.cli.engine_flags import add_engine_flags, engine_settings
from prism_pipeline.offline.backfill import BackfillOptions, BackfillSummary, run_backfill
from prism_pipeline.offline.errors import OfflineError
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


def _cmd_backfill(args: argparse.Namespace) -> int:
    from prism_pipeline.core.engine_setup import ConfigError, load_engine

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
            source = TopicSource(
                args.brokers, args.input_topic, args.partition, args.from_offset, args.to_offset
            )
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
            "resumable with no gaps or duplicates: rerun the same command."
        ),
    )
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
    p.set_defaults(func=_cmd_backfill)
