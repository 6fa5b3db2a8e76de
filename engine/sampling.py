"""Seeded, counter-based sampling for AutoThink thoughts.

Every draw is a pure function of (thought key, step) and the logits, where the thought key is
a digest of what the model sees - the record seed, the evidence's digest (the exact token prefix
the question hangs from) and the question's rendered prompt tokens - never of the question's key
or the event id. The uniform number comes from a hash of (key, step), never from a shared random
stream, so a question's thought does not depend on what else was in the batch, in which order it
ran, whether its prefix came from the cache, or which name the client gave the question: renaming
a key, or asking the same question twice, gives the same thought (JevBench key_rename and
duplicate_question).
Filtering (temperature, top-k, top-p) and the inverse-CDF draw run in float64 on the CPU with
ties broken by token id, so the same logits always give the same token.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence

import torch

THOUGHT_KEY_VERSION = b"prism-thought-v2"  # v1 hashed (seed, event id, question id, step)


def thought_key(seed: int, evidence_digest: str, question_tokens: Sequence[int]) -> bytes:
    """The counter key of one question's thought: a SHA-256 of what the model sees.

    `evidence_digest` names the exact prefix (system + evidence tokens, and images) the question
    hangs from; `question_tokens` are the question segment's tokens as rendered for the thought.
    Lengths are hashed before the variable parts, so no two different inputs share a byte string.
    """
    h = hashlib.sha256(THOUGHT_KEY_VERSION)
    for part in (str(seed).encode(), evidence_digest.encode()):  # any int seed, any digest form
        h.update(struct.pack(">I", len(part)) + part)
    h.update(struct.pack(f">I{len(question_tokens)}I", len(question_tokens), *question_tokens))
    return h.digest()


def uniform(key: bytes, step: int) -> float:
    """A uniform number in [0, 1) for draw `step` of the thought `key` (53 random bits)."""
    (bits,) = struct.unpack(">Q", hashlib.sha256(key + struct.pack(">Q", step)).digest()[:8])
    return (bits >> 11) * 2.0**-53


def sample_token(logits: torch.Tensor, u: float, *, temperature: float, top_p: float, top_k: int) -> int:
    """Draw one token from full-vocabulary logits with the given filters and uniform `u`.

    temperature 0 means greedy (lowest id among equal maxima).
    """
    _check_uniform(u)
    wide = logits.detach().to(device="cpu", dtype=torch.float64)
    if temperature <= 0.0:
        return int(torch.argmax(wide))  # first maximum
    # order: probability descending, then token id ascending (stable sort on ids)
    order = torch.argsort(-wide, stable=True)
    if top_k > 0:
        order = order[:top_k]
    return _draw(wide[order], order, u, temperature=temperature, top_p=top_p)


def sample_tokens(
    logits: torch.Tensor, us: Sequence[float], *, temperature: float, top_p: float, top_k: int
) -> list[int]:
    """`sample_token` for every row of logits [n, vocab] (any device) with its own uniform us[row].

    Returns exactly the tokens `sample_token` returns row by row, without sorting each full row
    on the host: with top-k on, each row's candidates - every logit >= its k-th largest, so
    ties at the cut are all there - are found on the device and only those move to the host,
    where they are ordered (logit descending, id ascending), cut to k and drawn from in the
    same float64 arithmetic. Everything is per row: a row's token never depends on the others.
    With top-k off (0, or at least the vocabulary) each row falls back to `sample_token`.
    """
    if logits.dim() != 2 or logits.shape[0] != len(us):
        raise ValueError(f"need logits [n, vocab] and n uniforms, got {tuple(logits.shape)} and {len(us)}")
    for u in us:
        _check_uniform(u)
    n, vocab = logits.shape
    if n == 0:
        return []
    if temperature <= 0.0:
        return [int(t) for t in torch.argmax(logits.detach(), dim=-1).tolist()]  # first maxima
    if top_k <= 0 or top_k >= vocab:
        return [
            sample_token(logits[r], u, temperature=temperature, top_p=top_p, top_k=top_k)
            for r, u in enumerate(us)
        ]
    x = logits.detach()
    kth = torch.topk(x, top_k, dim=-1).values[:, -1:]  # the k-th largest value (exact, whatever the ties)
    mask = x >= kth
    where = mask.nonzero()  # row-major: rows ascending, ids ascending within a row
    values = x[where[:, 0], where[:, 1]].to(device="cpu", dtype=torch.float64)
    ids = where[:, 1].cpu()
    counts = mask.sum(dim=-1).cpu().tolist()
    tokens: list[int] = []
    start = 0
    for r, u in enumerate(us):
        v, i = values[start : start + counts[r]], ids[start : start + counts[r]]
        start += counts[r]
        order = torch.argsort(-v, stable=True)[:top_k]
        tokens.append(_draw(v[order], i[order], u, temperature=temperature, top_p=top_p))
    return tokens


def _check_uniform(u: float) -> None:
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u}")


def _draw(candidates: torch.Tensor, ids: torch.Tensor, u: float, *, temperature: float, top_p: float) -> int:
    """Inverse-CDF draw over candidates (float64 logits, already in sampling order) with top-p."""
    scaled = candidates / temperature
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
            return int(ids[i])
    return int(ids[len(values) - 1])
