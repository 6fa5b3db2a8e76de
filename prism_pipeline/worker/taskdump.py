"""What every asyncio task of the worker is waiting on, for a stop that does not finish.

A thread dump (faulthandler, SIGUSR1) of a stuck worker shows the event loop idle in its selector:
true, and no help, because the stuck thing is a coroutine suspended somewhere. `task_dump` walks
each task's await chain (coroutine -> the coroutine it awaits -> ... -> the future at the end),
so the line names the awaiting task and the call it hangs in (`prism-txn-3`: `_publish_runs` ->
`transaction` -> `wait_for_transaction_end` ...). It is logged on SIGUSR1 and when a stop hits its
deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

_MAX_DEPTH = 32  # a chain this deep is a recursion, not something to print whole


def _frames(coro: Any) -> tuple[list[str], str | None]:
    """`file:line in function` for each coroutine of the chain, and what the last one awaits."""
    frames: list[str] = []
    obj = coro
    for _ in range(_MAX_DEPTH):
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        if frame is None:
            break
        code = frame.f_code
        frames.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} in {code.co_name}")
        nxt = getattr(obj, "cr_await", None)
        if nxt is None:
            nxt = getattr(obj, "gi_yieldfrom", None)
        if nxt is None:
            return frames, None
        obj = nxt
    leaf = None if obj is coro else repr(obj)[:200]
    return frames, leaf


def task_dump(loop: asyncio.AbstractEventLoop | None = None) -> list[dict[str, Any]]:
    """One entry per unfinished task: its name, its await chain (outermost first), its leaf."""
    out: list[dict[str, Any]] = []
    for task in sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name()):
        if task.done():
            continue
        frames, leaf = _frames(task.get_coro())
        out.append({"task": task.get_name(), "awaits": frames, "on": leaf})
    return out
