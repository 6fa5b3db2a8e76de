"""A replay report in words: what differs, field by field, and the verdict line."""

from __future__ import annotations

from collections import defaultdict

import structlog

from prism_pipeline.offline.replay import EventOutcome, ReplayReport, pos_text

log = structlog.get_logger(__name__)


def _version_summary(report: ReplayReport) -> list[str]:
    """One block per version change: which records it covers and what they still reproduce.

    A new engine or renderer version is allowed to move bits (each version's note in
    engine/engine.py says what moved), so listing every moved float would bury the one fact that
    matters: the records are from another version, and only that version can verify them.
    """
    groups: dict[tuple[tuple[str, str, str], ...], list[EventOutcome]] = defaultdict(list)
    for o in report.outcomes:
        if o.status == "different" and o.version_change:
            groups[o.version_change].append(o)
    lines = []
    for change, members in groups.items():
        what = ", ".join(f"{f} {theirs!r} (this replay: {mine!r})" for f, theirs, mine in change)
        same = sum(1 for o in members if o.only_versions_differ)
        moved = [o for o in members if o.changed_answers]
        lines.append(
            f"VERSION CHANGE: {len(members)} of {report.checked} checked records were decided under {what}; "
            "their differences are expected and not listed field by field (replay under the version "
            "that made them to check them bit for bit)"
        )
        lines.append(
            f"  {same} reproduce every field but the version; {len(members) - same - len(moved)} keep every "
            f"answer but move read-out/thought bits; {len(moved)} change an answer"
        )
    return lines


def render_report(report: ReplayReport, max_diffs: int = 50) -> str:
    lines = _version_summary(report)
    shown = 0
    for o in report.outcomes:
        if o.status not in ("different", "missing"):
            continue
        where = pos_text(o.position) if o.position[0] else "-"
        lines.append(
            f"{o.status.upper()} {o.event_id or '?'} (input {where}){': ' + o.note if o.note else ''}"
        )
        if o.status == "different" and o.version_change:
            answers = ", ".join(o.changed_answers) or "none"
            lines.append(f"  another version: {len(o.diffs)} field(s) differ; answers changed: {answers}")
            continue
        for d in o.diffs:
            if shown >= max_diffs:
                break
            lines.append(f"  {d.render()}")
            shown += 1
    if shown >= max_diffs:
        lines.append(f"  ... (more differences not shown; --max-diffs {max_diffs})")
    lines.extend(f"note: {n}" for n in report.notes)
    total = len(report.outcomes)
    lines.append(
        f"replay: {total} selected, {report.checked} checked, {report.count('identical')} identical, "
        f"{report.count('different')} different, {report.count('missing')} missing, "
        f"{report.count('invalid') + report.count('rejected')} without a record by design "
        f"(invalid or rejected) in {report.seconds:.1f} s"
        + (f"; {report.published} records published" if report.published else "")
    )
    versioned = sum(1 for o in report.outcomes if o.status == "different" and o.version_change)
    if report.ok:
        lines.append("RESULT: all identical")
    elif versioned and versioned == report.count("different") and not report.count("missing"):
        lines.append("RESULT: DIFFERENCES FOUND, all in records of another engine/render version")
    else:
        lines.append("RESULT: DIFFERENCES FOUND")
    return "\n".join(lines) + "\n"
