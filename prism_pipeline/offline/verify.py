"""Re-decide published records and compare them byte for byte (the demo's replay check).

Records are pure functions of (event, model digest, precision path, decision config, seed, input
position). The int8 path is batch invariant, so any regrouping reproduces them; the fp32/bf16
reference paths are not (their float reductions depend on the batch's shape, at the 1e-8 level),
so events are re-decided in the same batches, in the same order, as the worker's `prism-batch` /
`prism-batch-pos` headers say they were.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from prism_pipeline.core.records import DecisionEngine, build_record, decide_request, provenance
from prism_pipeline.core.seeds import SeedPolicy
from schemas.codec import dumps
from schemas.deadletter import parse_event
from schemas.record import InputRef
from schemas.systemone import Limits


@dataclass(frozen=True)
class PublishedRecord:
    """A decision record read back from Kafka, with the input event it claims to decide."""

    value: bytes
    event_raw: bytes
    input: InputRef
    batch: str
    batch_pos: int


def batch_groups(records: list[PublishedRecord]) -> list[list[PublishedRecord]]:
    """Records grouped by the engine call that decided them, each group in batch order."""
    groups: dict[str, list[PublishedRecord]] = defaultdict(list)
    for r in records:
        groups[r.batch].append(r)
    return [sorted(g, key=lambda r: r.batch_pos) for g in groups.values()]


def redecide(
    engine: DecisionEngine,
    records: list[PublishedRecord],
    *,
    seed_policy: SeedPolicy = "event",
    fixed_seed: int = 0,
    limits: Limits | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Event ids whose re-decided record differs from the published bytes (empty: all equal).
    `progress(done, total)` runs after each re-decided batch (the demo shows it)."""
    model = provenance(engine)
    mismatches: list[str] = []
    done = 0
    for group in batch_groups(records):
        events = [parse_event(r.event_raw, limits) for r in group]
        requests = [decide_request(e, seed_policy, fixed_seed) for e in events]
        results = engine.decide(requests)
        for rec, event, request, result in zip(group, events, requests, results, strict=True):
            again = dumps(build_record(event, request, result, model, rec.input))
            if again != rec.value:
                mismatches.append(event.event_id)
        done += len(group)
        if progress is not None:
            progress(done, len(records))
    return mismatches
