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

from prism_pipeline.core.batching import recorded_batches
from prism_pipeline.core.decide import DecisionRules, Origin, Prepared, decide_batch, prepare, settle
from prism_pipeline.core.records import DecisionEngine, provenance
from prism_pipeline.core.seeds import SeedPolicy
from schemas.codec import dumps
from schemas.record import DecisionRecord, InputRef
from schemas.systemone import Limits


@dataclass(frozen=True)
class PublishedRecord:
    """A decision record read back from Kafka, with the input event it claims to decide."""

    value: bytes
    event_raw: bytes
    input: InputRef
    batch: str
    batch_pos: int


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
    rules = DecisionRules(limits, seed_policy, fixed_seed)
    members: dict[str, list[int]] = defaultdict(list)
    for i in sorted(range(len(records)), key=lambda i: records[i].batch_pos):
        members[records[i].batch].append(i)
    # Every record is re-decided in its recorded batch, whatever the path (the demo runs fp32).
    groups = recorded_batches(
        range(len(records)), lambda i: records[i].batch, members.__getitem__, lambda _: False
    )
    mismatches: list[str] = []
    done = 0
    for group in groups:
        prepared: list[tuple[PublishedRecord, Prepared]] = []
        for rec in (records[i] for i in group):
            prep = prepare(rec.event_raw, engine, rules)
            if isinstance(prep, Prepared):
                prepared.append((rec, prep))
            else:  # the worker would have dead-lettered it, not published a record
                mismatches.append(f"{rec.input.topic}/{rec.input.partition}@{rec.input.offset}")
        results = decide_batch(engine.decide, [p.request for _, p in prepared]).results if prepared else []
        for (rec, prep), res in zip(prepared, results, strict=True):
            where = Origin(rec.input.topic, rec.input.partition, rec.input.offset)
            again = settle(rec.event_raw, prep, res, model, where, source=rec.input)
            if not isinstance(again, DecisionRecord) or dumps(again) != rec.value:
                mismatches.append(prep.event.event_id)
        done += len(group)
        if progress is not None:
            progress(done, len(records))
    return mismatches
