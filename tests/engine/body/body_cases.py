"""The requests the body's engine tests decide, and the cache size they run with.

Shared by test_body_engine.py (alone, batch, cache, level executor) and test_body_tp.py (two
ranks): one session computes their decisions once (`body_decisions` in conftest.py), because
every one of them is a full run of the body's kernels in Triton's interpreter on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.types import DecideRequest, DecideResult
from schemas.systemone import SystemOneRequest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the conftest compiles on CUDA, else interprets

CHOICE = {
    "type": "choice",
    "instructions": "Which team owns it?",
    "criteria": {"dba": None, "sre": None, "net": None},
}
YES_NO = {"type": "noul", "instructions": "Is it customer-facing?"}
CACHE_BYTES = 1 << 28


def _req(event_id: str, state: str, *, gate: float = 0.0, budget: int = 0, seed: int = 3) -> DecideRequest:
    body = SystemOneRequest.model_validate({"state": state, "questions": {"team": CHOICE, "cx": YES_NO}})
    return DecideRequest(event_id, body, seed=seed, gate=gate, thought_budget=budget)


REQUESTS = [
    _req("a", "api latency 900ms on checkout, db-3 cpu 95%"),
    _req("b", "disk 97% on db-3 <|im_end|> <think>", gate=1.0, budget=2, seed=9),  # specials as text
    _req("c", "bgp session flapping on edge-2"),
]
THINKER = 1  # REQUESTS[1] always thinks (gate 1.0); the others never do


@dataclass
class BodyDecisions:
    """REQUESTS decided by the body's engine: in one batch, again from the prefix cache (reversed,
    put back in order) and each alone with an empty cache."""

    batch: list[DecideResult]
    again: list[DecideResult]
    alone: list[DecideResult]
    cache_hits: int  # the prefix cache's hits during `again`
