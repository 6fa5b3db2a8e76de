"""`prism replay`: the flags and the terminal output."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime
from pathlib import Path

from prism_pipeline.core.engine_setup import PATHS
from prism_pipeline.offline.engines import EngineSource
from prism_pipeline.offline.errors import OfflineError, ReplayRefused
from prism_pipeline.offline.replay import ReplayOptions, replay
from prism_pipeline.offline.report import render_report
from prism_pipeline.offline.selection import Selection
from schemas.systemone import Limits


def _parse_time(text: str) -> datetime:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date-time: {text!r}") from None


def _cmd_replay(args: argparse.Namespace) -> int:
    from prism_pipeline.logs import install_uvloop

    sel = Selection(
        topic=args.topic,
        partitions=tuple(args.partition) if args.partition else None,
        from_offset=args.from_offset,
        to_offset=args.to_offset,
        from_time=args.from_time,
        to_time=args.to_time,
        event_ids=tuple(args.event_id or ()),
    )
    engines = EngineSource(
        [Path(m) for m in args.model],
        decision_config=Path(args.decision_config) if args.decision_config else None,
        device=args.device,
        precision=args.precision,
    )
    options = ReplayOptions(
        seed_policy=args.seed_policy,
        fixed_seed=args.fixed_seed,
        limits=Limits(max_questions=args.max_questions, max_state_chars=args.max_state_chars),
    )
    install_uvloop()
    try:
        report = asyncio.run(
            replay(
                args.brokers,
                args.records,
                sel,
                engines,
                options,
                publish=args.publish,
                explain_event=args.explain,
            )
        )
    except ReplayRefused as e:
        sys.stderr.write(f"prism replay: refusing to replay: {e}\n")
        return 2
    except OfflineError as e:  # ReplayError, or a Kafka range that cannot be read
        sys.stderr.write(f"prism replay: {e}\n")
        return 2
    if report.explain:
        sys.stdout.write(report.explain + "\n")
    sys.stdout.write(render_report(report, args.max_diffs))
    return 0 if report.ok else 1


def add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="re-decide recorded events and compare the decision records bit for bit",
        description=(
            "Select input events (topic + offset or time range, or event ids, or both: the ids within "
            "the range), re-decide them with the "
            "model and config their records name, and compare the records byte for byte. Exit 0 only "
            "when every selected event's record is identical; 1 on differences or missing records; "
            "2 when replay cannot run (e.g. the model file's digest differs from the records')."
        ),
    )
    p.add_argument("--brokers", default="localhost:9092", help="Kafka bootstrap servers")
    p.add_argument("--records", default="prism.decisions", help="decisions topic (default prism.decisions)")
    p.add_argument("--topic", help="input (evidence) topic to select a range of")
    p.add_argument("--partition", type=int, action="append", help="input partition (repeatable; default all)")
    p.add_argument("--from-offset", type=int, help="first input offset (inclusive)")
    p.add_argument("--to-offset", type=int, help="last input offset (exclusive)")
    p.add_argument("--from-time", type=_parse_time, help="ISO 8601: first message at or after this time")
    p.add_argument("--to-time", type=_parse_time, help="ISO 8601: messages before this time")
    p.add_argument(
        "--event-id",
        action="append",
        help=(
            "replay this event (repeatable), found via the records; with --topic only these events, "
            "and one not in the topic (range) is an error"
        ),
    )
    p.add_argument("--model", action="append", default=[], help="GGUF file(s) the records were decided with")
    p.add_argument("--decision-config", help="decision_config.json (default: beside the model)")
    p.add_argument("--device", default="cpu", help="engine device (default cpu)")
    p.add_argument(
        "--precision",
        choices=PATHS,
        help="refuse records of another path (default: theirs)",
    )
    p.add_argument("--seed-policy", default="event", choices=["event", "id", "fixed"], help="as the worker's")
    p.add_argument("--fixed-seed", type=int, default=0, help="as the worker's")
    p.add_argument("--max-questions", type=int, default=64, help="as the worker's")
    p.add_argument("--max-state-chars", type=int, default=1_000_000, help="as the worker's")
    p.add_argument("--publish", metavar="TOPIC", help="also write the replayed records to this topic")
    p.add_argument("--explain", metavar="EVENT_ID", help="print this decision: prompt, thought, read-outs")
    p.add_argument("--max-diffs", type=int, default=50, help="field differences to print (default 50)")
    p.set_defaults(func=_cmd_replay)
