"""Operator ceilings on the work one request may cause, shared by `prism serve`, `prism run` and
`backfill`.

A request (an HTTP body or a Kafka event) may ask for a higher AutoThink gate or a larger thought
budget; the operator's ceilings cap both inside the engine (`DecideRequest.max_gate` and
`max_thought_budget`), so a client can lower them and never raise them past what the operator
allowed. The checks here run before any tokenization: they are cheap on purpose.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from engine.types import DecideRequest

# orjson (which every path uses to render, digest and publish a state) refuses values nested more
# than 254 levels, and the HTTP event id digests the state wrapped in one more list: 253 is the
# deepest state every path can take. Deeper is refused up front, with the depth, not as a 500.
MAX_STATE_DEPTH = 253


def nesting_depth(value: Any, stop: int = MAX_STATE_DEPTH + 1) -> int:
    """Levels of arrays/objects in a parsed JSON value (a scalar is 0), counted up to `stop`.

    Iterative, so a hostile 100,000-deep value costs one pass and no Python recursion.
    """
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list | tuple):
            children = v
        else:
            continue
        d += 1
        if d > deepest:
            deepest = d
            if deepest >= stop:
                return deepest
        stack.extend((c, d) for c in children)
    return deepest


def too_deep(state: Any) -> str | None:
    """Why `state` nests too deep for every path to handle, or None."""
    depth = nesting_depth(state)
    if depth > MAX_STATE_DEPTH:
        return f"state nests {depth}+ levels deep; at most {MAX_STATE_DEPTH} are accepted"
    return None


@dataclass(frozen=True)
class Ceilings:
    """What the operator allows one request at most (None: no ceiling beyond the engine's own).

    `max_gate`: the highest AutoThink gate a request or question may ask for (a gate of 1 forces a
    thought on every question). `max_thought_budget`: thought tokens per question. `deadline_s`:
    seconds from arrival after which the request's thoughts stop (HTTP only: a Kafka record must
    not depend on timing).
    """

    max_gate: float | None = None
    max_thought_budget: int | None = None
    deadline_s: float | None = None

    def apply(self, request: DecideRequest, arrived: float | None = None) -> DecideRequest:
        """`request` under these ceilings; with a deadline, one that starts at `arrived` (monotonic)."""
        deadline = None
        if self.deadline_s is not None:
            deadline = (time.monotonic() if arrived is None else arrived) + self.deadline_s
        return dataclasses.replace(
            request,
            max_gate=_lowest(request.max_gate, self.max_gate),
            max_thought_budget=_lowest(request.max_thought_budget, self.max_thought_budget),
            deadline=_lowest(request.deadline, deadline),
        )


def _lowest(a: Any, b: Any) -> Any:
    if a is None:
        return b
    return a if b is None else min(a, b)
