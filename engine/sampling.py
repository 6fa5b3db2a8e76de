"""Seeded, counter-based sampling for AutoThink thoughts.

Every draw is a pure function of (record seed, event id, question id, step) and the logits:
the uniform number comes from a hash of that tuple, never from a shared random stream, so a
question's thought does not depend on what else was in the batch or in which order it ran.
Filtering (temperature, top-k, top-p) and the inverse-CDF draw run in float64 on the CPU with
ties broken by token id, so the same logits always give the same token.
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch


def uniform(seed: int, event_id: str, question_id: str, step: int) -> float:
    """A uniform number in [0, 1) keyed by the counter tuple (53 random bits)."""
    key = f"{seed}\x1f{event_id}\x1f{question_id}\x1f{step}".encode()
    (bits,) = struct.unpack(">Q", hashlib.sha256(key).digest()[:8])
    return (bits >> 11) * 2.0**-53


def sample_token(logits: torch.Tensor, u: float, *, temperature: float, top_p: float, top_k: int) -> int:
    """Draw one token from full-vocabulary logits with the given filters and uniform `u`.

    temperature 0 means greedy (lowest id among equal maxima).
    """
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u}")
    wide = logits.detach().to(device="cpu", dtype=torch.float64)
    if temperature <= 0.0:
        return int(torch.argmax(wide))  # first maximum
    # order: probability descending, then token id ascending (stable sort on ids)
    order = torch.argsort(-wide, stable=True)
    if top_k > 0:
        order = order[:top_k]
    scaled = wide[order] / temperature
    probs = torch.softmax(scaled - scaled.max(), dim=0)
    if top_p < 1.0:
        cumulative = torch.cumsum(probs, dim=0)
        keep = int(torch.searchsorted(cumulative, torch.tensor([top_p], dtype=torch.float64)).item()) + 1
        probs = probs[: max(1, min(keep, probs.numel()))]
    total = math.fsum(probs.tolist())
    target = u * total
    running = 0.0
    values = probs.tolist()
    for i, p in enumerate(values):
        running += p
        if target < running:
            return int(order[i])
    return int(order[len(values) - 1])
