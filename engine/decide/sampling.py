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
ties broken by token id, so the same logits always give the same token; with top-k on, the draw
uses IEEE-754 basic operations only (`portable_exp`, left-to-right sums), so it gives that token
on any machine too.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Sequence

import torch

from engine.decide.portable_exp import portable_exp
from engine.kernels.draw import DrawSettings, step_drawn_tokens
from engine.kernels.top_k import packed_top_k, step_top_k_rows

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
    if 0 < top_k < wide.numel():
        order = order[:top_k]
        return _draw(wide[order].tolist(), order.tolist(), u, temperature=temperature, top_p=top_p)
    return _draw_wide(wide[order], order, u, temperature=temperature, top_p=top_p)


def sample_tokens(
    logits: torch.Tensor | Sequence[torch.Tensor],
    us: Sequence[float],
    *,
    temperature: float,
    top_p: float,
    top_k: int,
) -> list[int]:
    """`sample_token` for every row of logits ([n, vocab], or n rows [vocab], any device) with its
    own uniform us[row].

    Returns exactly the tokens `sample_token` returns row by row, without sorting any full row:
    with top-k on, each row's k largest are found on the logits' device
    (`engine.kernels.top_k.packed_top_k`), and one copy brings them to the host with, per row, how
    many logits reach the k-th largest and how many are NaN (a row with NaN raises ValueError: its
    order, hence its token, would mean nothing). Rows of a decode step's logits whose step made
    those numbers in its graph (`engine.kernels.top_k.StepTopK`) take them from there and launch
    nothing. Where that count is k (the usual case) those k are the row's candidates; where a tie
    straddles the cut (more logits equal the k-th), every logit >= it is fetched for that row, so
    the cut keeps the lowest ids exactly as the full sort does. The host orders the candidates
    (logit descending, id ascending) and draws in float64. With top-k off (0, or at least the
    vocabulary) each row falls back to `sample_token`. Rows whose decode step also drew their token
    in its graph with these settings and this row's uniform (`engine.kernels.draw.StepDraw`: the
    same operations in float64, so the same token) take that token and need nothing else.
    Everything is per row: a row's token never depends on the others.
    """
    rows = list(logits)
    if any(x.dim() != 1 for x in rows) or len(rows) != len(us) or len({x.numel() for x in rows}) > 1:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else [tuple(x.shape) for x in rows]
        raise ValueError(
            f"need logits [n, vocab] (or n rows of one vocabulary) and n uniforms, got {shape} and {len(us)}"
        )
    for u in us:
        _check_uniform(u)
    n = len(rows)
    if n == 0:
        return []
    vocab = rows[0].numel()

    def stacked(index: Sequence[int]) -> torch.Tensor:
        if isinstance(logits, torch.Tensor) and len(index) == n:
            return logits.detach()
        return torch.stack([rows[r].detach() for r in index])

    if temperature <= 0.0:
        return [int(t) for t in torch.argmax(stacked(range(n)), dim=-1).tolist()]  # first maxima
    if top_k <= 0 or top_k >= vocab:
        return [
            sample_token(x, u, temperature=temperature, top_p=top_p, top_k=top_k)
            for x, u in zip(rows, us, strict=True)
        ]
    drawn = step_drawn_tokens(rows, us, DrawSettings(top_k, temperature, top_p))  # a step's own draws
    todo = [r for r, token in enumerate(drawn) if token is None]
    if todo:  # (all rows: `stacked` still hands over the caller's block itself)
        made = _top_k_tokens(
            [rows[r] for r in todo],
            [us[r] for r in todo],
            lambda index: stacked([todo[i] for i in index]),
            todo,
            top_k=top_k,
            temperature=temperature,
            top_p=top_p,
        )
        for r, token in zip(todo, made, strict=True):
            drawn[r] = token
    assert all(token is not None for token in drawn)
    return drawn  # type: ignore[return-value]


def _top_k_tokens(
    rows: list[torch.Tensor],
    us: Sequence[float],
    stacked: Callable[[Sequence[int]], torch.Tensor],
    numbers: Sequence[int],
    *,
    top_k: int,
    temperature: float,
    top_p: float,
) -> list[int]:
    """`sample_tokens`' top-k draw on the host for these rows (`stacked(index)`: those rows as one
    tensor; `numbers`: their places in the caller's rows, for errors): their numbers from the step
    that made them, else `packed_top_k` on their device."""
    packed, missing = step_top_k_rows(rows, top_k)  # the numbers a decode step made in its graph
    if missing:  # one device -> host copy: ids, the values' fp32 bits, the counts (exact in int64)
        made = packed_top_k(stacked(missing).float(), top_k).cpu()
        if packed is None:
            packed = made
        else:
            packed[missing] = made
    assert packed is not None
    # bulk conversions, not per-row ones: at 64 rows a step, per-row tensor ops cost the host ms
    rows_ids = packed[:, :top_k].tolist()
    rows_values = packed[:, top_k : 2 * top_k].to(torch.int32).view(torch.float32).double().tolist()
    reaches = packed[:, 2 * top_k].tolist()
    for r, nan in enumerate(packed[:, 2 * top_k + 1].tolist()):
        if nan:
            raise ValueError(
                f"row {numbers[r]} of the logits holds {nan} NaN value(s) (a broken forward pass): no token "
                "can be drawn from it"
            )
    tokens: list[int] = []
    for r, u in enumerate(us):
        vals, idx = rows_values[r], rows_ids[r]  # top-k's order: values descending
        if reaches[r] != top_k or any(a == b for a, b in zip(vals, vals[1:], strict=False)):
            if reaches[r] == top_k:
                pairs = list(zip(vals, idx, strict=True))  # equal values: put them in id order
            else:  # a tie across the cut: all the tied logits, so the lowest ids stay
                x = rows[r].detach().float()
                where = (x >= vals[-1]).nonzero()[:, 0]  # vals[-1]: the k-th's fp32 value, exact
                pairs = list(zip(x[where].double().tolist(), where.tolist(), strict=True))
            pairs.sort(key=lambda pair: (-pair[0], pair[1]))
            vals, idx = [v for v, _ in pairs[:top_k]], [i for _, i in pairs[:top_k]]
        tokens.append(_draw(vals, idx, u, temperature=temperature, top_p=top_p))
    return tokens


def _check_uniform(u: float) -> None:
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u}")


def _draw(candidates: list[float], ids: list[int], u: float, *, temperature: float, top_p: float) -> int:
    """Inverse-CDF draw over top-k candidates (logits as float64, already in sampling order).

    float64 arithmetic of IEEE-754 basic operations only, in a fixed order, so a candidate list
    gives the same token wherever it came from (one row or a batch) and on any machine, and a
    kernel doing the same operations draws the same token: the weights are
    `portable_exp(l/T - max)` (not the host libm's exp), the normaliser is their left-to-right sum
    (an explicit loop: Python 3.12's `sum` compensates, `math.fsum` rounds differently again), the
    probabilities are weight / normaliser; top-p keeps the shortest head whose running sum (left
    to right) reaches top_p; the draw walks that head until u times the head's running sum is
    passed.
    """
    scaled = [v / temperature for v in candidates]
    top = scaled[0]
    weights = [portable_exp(s - top) for s in scaled]
    norm = 0.0
    for w in weights:
        norm += w
    probs = [w / norm for w in weights]
    running: list[float] = []
    total = 0.0
    for p in probs:
        total += p
        running.append(total)
        if total >= top_p and top_p < 1.0:
            break
    target = u * running[-1]
    for i, passed in enumerate(running):
        if target < passed:
            return int(ids[i])
    return int(ids[len(running) - 1])


def _draw_wide(
    candidates: torch.Tensor, ids: torch.Tensor, u: float, *, temperature: float, top_p: float
) -> int:
    """`_draw` for top-k off (the whole vocabulary, sorted): the same steps as torch float64 ops,
    since a Python loop over every token would take tens of milliseconds."""
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
