"""OffsetTracker against an oracle: the commit point is the smallest un-acked tracked offset,
or one past the largest tracked offset when everything is acked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_pipeline.worker.offsets import OffsetTracker


def oracle(tracked: list[int], acked: set[int]) -> int | None:
    if not tracked:
        return None
    unacked = [o for o in tracked if o not in acked]
    return min(unacked) if unacked else max(tracked) + 1


@st.composite
def schedules(draw: st.DrawFn) -> list[tuple[str, int]]:
    """Interleaved track/ack operations: offsets increase with gaps, acks hit tracked offsets in any order."""
    gaps = draw(st.lists(st.integers(1, 3), min_size=1, max_size=40))
    start = draw(st.integers(0, 1000))
    offsets, o = [], start
    for g in gaps:
        offsets.append(o)
        o += g
    ops: list[tuple[str, int]] = []
    pending: list[int] = []
    to_track = list(offsets)
    while to_track or pending:
        track = to_track and (not pending or draw(st.booleans()))
        if track:
            off = to_track.pop(0)
            ops.append(("track", off))
            pending.append(off)
        else:
            off = pending.pop(draw(st.integers(0, len(pending) - 1)))
            ops.append(("ack", off))
    return ops


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_commit_point_matches_oracle(ops: list[tuple[str, int]]) -> None:
    t = OffsetTracker()
    tracked: list[int] = []
    acked: set[int] = set()
    for op, off in ops:
        before = t.committable
        if op == "track":
            t.track(off)
            tracked.append(off)
        else:
            moved = t.ack(off)
            acked.add(off)
            assert moved == (t.committable != before)
        assert t.committable == oracle(tracked, acked)
        assert t.in_flight == len(tracked) - len(acked)
        assert list(t.pending_in_order()) == [o for o in tracked if o not in acked]
    assert t.in_flight == 0


def test_hand_case_out_of_order_acks() -> None:
    t = OffsetTracker()
    assert t.committable is None
    for off in (5, 6, 7, 9):  # 8 is a transaction marker: never delivered
        t.track(off)
    assert t.committable == 5
    assert not t.ack(7)
    assert t.committable == 5
    assert t.ack(5)
    assert t.committable == 6
    assert t.ack(6)  # 6 and the already-acked 7 go behind the commit point
    assert t.committable == 9
    assert t.ack(9)
    assert t.committable == 10


def test_refuses_misuse() -> None:
    t = OffsetTracker()
    t.track(3)
    with pytest.raises(ValueError, match="must increase"):
        t.track(3)
    with pytest.raises(KeyError):
        t.ack(4)
    t.ack(3)
    with pytest.raises(KeyError):
        t.ack(3)  # acking twice would hide a bookkeeping bug
