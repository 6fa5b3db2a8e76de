"""Letter read-out: from the next-token logits at the read position to option probabilities.

StartLux's protocol (DESIGN §1): take the logits of the listed letters (A, B, ...) at the
last prompt position, divide by the per-type temperature, softmax over the listed letters
only. We also report `coverage`, the mass the full vocabulary (temperature 1) puts on the
listed letters; 1 − coverage is what the model wanted to say instead of a letter.

Precision: the letter part runs in float64 in plain Python over at most 26 numbers. Every
float32 logit is exact in float64, `math.fsum` rounds the normaliser once, so the result is
independent of letter order, of torch's kernels and of the device, and the probabilities
sum to 1 within a few ulp (far inside the 1e-6 contract). Coverage's full-vocabulary sum runs
in float64 shifted by the vocabulary max (no overflow): on the host for CPU logits, and for
CUDA logits on the device in fixed-order chunks folded exactly on the host
(`engine.kernels.vocab_mass`, `fold_vocab_mass`).

Choice questions with more than 26 options run in rounds; see `ChoiceRounds`.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kernels.attached import block_rows

MAX_LETTERS = 26  # A..Z, each a single token in the Qwen3.5 vocabulary
GROUP_SIZE = 25  # options per first-round group (StartLux)
FINALISTS_PER_GROUP = 3  # each group's top 3 go on (StartLux)
SUM_TOLERANCE = 1e-6
_TINY = sys.float_info.min  # smallest positive normal float64: the floor for round results


# ---------------------------------------------------------------------------------------------
# validation helpers


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    t = float(temperature)
    if not math.isfinite(t) or t <= 0.0:
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    return t


def _check_letter_logits(letter_logits: Sequence[float]) -> list[float]:
    values = [float(x) for x in letter_logits]
    if not values:
        raise ValueError("no letter logits: a read-out needs at least one listed letter")
    if len(values) > MAX_LETTERS:
        raise ValueError(f"{len(values)} letters listed; at most {MAX_LETTERS} (A..Z) fit in one read-out")
    bad = [i for i, x in enumerate(values) if not math.isfinite(x)]
    if bad:
        raise ValueError(f"letter logits must be finite; positions {bad} are {[values[i] for i in bad]}")
    return values


def check_probabilities(name: str, probabilities: Sequence[float]) -> list[float]:
    """The values as floats; ValueError naming `name` unless finite, >= 0 and summing to 1
    within SUM_TOLERANCE."""
    values = [float(p) for p in probabilities]
    if not values:
        raise ValueError(f"{name}: empty probability list")
    if any(not math.isfinite(p) or p < 0.0 for p in values):
        raise ValueError(f"{name}: probabilities must be finite and >= 0, got {values}")
    total = math.fsum(values)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise ValueError(f"{name}: probabilities sum to {total!r}, not 1 within {SUM_TOLERANCE}")
    return values


def first_argmax(values: Sequence[float]) -> int:
    """Index of the largest value; ties go to the earliest (display order)."""
    best = 0
    for i in range(1, len(values)):
        if values[i] > values[best]:
            best = i
    return best


# ---------------------------------------------------------------------------------------------
# one read-out


@dataclass(frozen=True)
class LetterReadout:
    """One read of the listed letters.

    `logits` are the raw values from the logits tensor (float32 values held exactly as
    Python floats); `probabilities` are softmax(logits / temperature) over the listed letters
    in float64; `coverage` is the temperature-1 full-vocabulary mass on the listed letters
    (None when not computed).
    """

    letter_ids: tuple[int, ...]
    logits: tuple[float, ...]
    temperature: float
    probabilities: tuple[float, ...]
    coverage: float | None = None

    @property
    def top(self) -> int:
        """Position of the most probable letter; ties go to the earliest."""
        return first_argmax(self.probabilities)

    @property
    def top_probability(self) -> float:
        """What the AutoThink gate compares against."""
        return self.probabilities[self.top]

    def to_dict(self) -> dict[str, Any]:
        return {
            "letter_ids": list(self.letter_ids),
            "logits": list(self.logits),
            "temperature": self.temperature,
            "probabilities": list(self.probabilities),
            "coverage": self.coverage,
        }


def letter_probabilities(letter_logits: Sequence[float], temperature: float) -> tuple[float, ...]:
    """softmax(letter_logits / temperature) in float64, max-shifted, normaliser by `fsum`."""
    return _softmax(_check_letter_logits(letter_logits), _check_temperature(temperature))


def _softmax(values: list[float], t: float) -> tuple[float, ...]:
    """`letter_probabilities` of checked values and temperature."""
    z = [x / t for x in values]
    m = max(z)
    e = [math.exp(v - m) for v in z]
    s = math.fsum(e)  # >= 1: the max term is exp(0)
    return tuple(v / s for v in e)


def coverage_from_logsumexp(letter_logits: Sequence[float], log_normalizer: float) -> float:
    """Mass on the listed letters given the full vocabulary's logsumexp at temperature 1
    (for an engine that reduces the vocabulary itself): exp(logsumexp(letters) −
    logsumexp(vocab)), clamped to 1. Absolute error about |logsumexp|·1e-16."""
    values = _check_letter_logits(letter_logits)
    lse_all = float(log_normalizer)
    if not math.isfinite(lse_all):
        raise ValueError(f"log_normalizer must be finite, got {log_normalizer!r}")
    m = max(values)
    lse_letters = m + math.log(math.fsum(math.exp(v - m) for v in values))
    return min(1.0, math.exp(lse_letters - lse_all))


def vocab_logsumexp(logits: torch.Tensor) -> float:
    """Stable logsumexp of the full-vocabulary logits in float64."""
    return float(torch.logsumexp(logits.detach().to(torch.float64), dim=0).item())


def _check_logits_tensor(logits: torch.Tensor, *, scan_values: bool = True) -> None:
    """Type, shape and (scan_values) no NaN or +inf entry: a device read-out counts those itself."""
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 1:
        raise ValueError(
            f"logits must be 1-D (the vocabulary at one position), got shape {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.numel() == 0:
        raise ValueError("logits tensor is empty")
    if not scan_values:
        return
    if bool(torch.isnan(logits).any()):
        n = int(torch.isnan(logits).sum())
        raise ValueError(f"logits contain {n} NaN value(s)")
    if bool(torch.isposinf(logits).any()):
        raise ValueError("logits contain +inf")


def _check_letter_ids(letter_ids: Sequence[int], vocab_size: int) -> list[int]:
    raw = list(letter_ids)
    if not raw:
        raise ValueError("letter_ids is empty: a read-out needs at least one listed letter")
    if len(raw) > MAX_LETTERS:
        raise ValueError(f"{len(raw)} letter ids; at most {MAX_LETTERS} (A..Z) fit in one read-out")
    ids = []
    for i in raw:
        try:
            if isinstance(i, bool):
                raise TypeError
            ids.append(operator.index(i))  # ints, numpy and 0-d torch integers
        except TypeError:
            raise ValueError(f"letter ids must be integers, got {i!r}") from None
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ValueError(f"letter id {i} outside the vocabulary [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"duplicate letter ids {dupes}")
    return ids


def readout_from_letter_logits(
    letter_ids: Sequence[int],
    letter_logits: Sequence[float],
    temperature: float,
    log_normalizer: float | None = None,
) -> LetterReadout:
    """Build a read-out when the engine computed only the letter rows of the LM head, plus
    (optionally) the full-vocabulary logsumexp for coverage."""
    ids = list(letter_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate letter ids {sorted({i for i in ids if ids.count(i) > 1})}")
    values = _check_letter_logits(letter_logits)
    if len(ids) != len(values):
        raise ValueError(f"{len(ids)} letter ids but {len(values)} letter logits")
    probs = letter_probabilities(values, temperature)
    cov = None if log_normalizer is None else coverage_from_logsumexp(values, log_normalizer)
    return LetterReadout(tuple(ids), tuple(values), float(temperature), probs, cov)


def read_letters(
    logits: torch.Tensor,
    letter_ids: Sequence[int],
    temperature: float,
    *,
    coverage: bool = True,
) -> LetterReadout:
    """Read the listed letters from the full-vocabulary next-token logits at one position.

    `letter_ids[i]` is the token of the i-th displayed letter (A, B, ...). Raises ValueError
    on an empty/duplicate/out-of-range id list, more than 26 letters, temperature <= 0, or
    NaN/+inf logits.
    """
    return read_letters_many([logits], [letter_ids], [temperature], coverage=coverage)[0]


# How `read_letters_many` reads CUDA rows (a bench flips it in one process): "batched" - every
# row's kernels queued without a sync, one copy back; "per_row" - each row read alone, its letter
# ids uploaded with a sync and its results copied back before the next row starts (engine 0.5.0);
# "block" - as "batched", but where every row is a row of one fp32 block (a pass's logits) the
# partials of the whole block in one launch (`vocab_partials_rows`) and the copy back into pinned
# memory (no pageable staging): fewer launches and a shorter wait after the pass, the same values.
DEVICE_READS = ("batched", "per_row", "block")
DEVICE_READ = "batched"


def read_letters_many(
    rows: Sequence[torch.Tensor],
    letter_ids: Sequence[Sequence[int]],
    temperatures: Sequence[float],
    *,
    coverage: bool = True,
) -> list[LetterReadout]:
    """`read_letters` of each (row, its letter ids, its temperature), the same values.

    Why at once: a CUDA row's read-out is a few small kernels and a copy back; queued for every
    row together (the letter ids go up without a sync, `_device_masses`) they run behind the pass
    that made the logits while the host is still queueing, and one copy brings every row's
    numbers back. Row by row, each row waited for the previous row's copy."""
    if not len(rows) == len(letter_ids) == len(temperatures):
        raise ValueError(
            f"{len(rows)} rows, {len(letter_ids)} letter id lists and {len(temperatures)} temperatures"
        )
    on_device = [coverage and isinstance(x, torch.Tensor) and x.is_cuda for x in rows]
    ids_of: list[list[int]] = []
    for logits, ids, on_dev, t in zip(rows, letter_ids, on_device, temperatures, strict=True):
        # a CUDA row's mass is reduced on the device (which also counts NaN and +inf entries)
        _check_logits_tensor(logits, scan_values=not on_dev)
        ids_of.append(_check_letter_ids(ids, logits.numel()))
        _check_temperature(t)
    device_rows = [r for r, on_dev in enumerate(on_device) if on_dev]
    masses: dict[int, tuple[float, float, list[float]]] = {}
    if DEVICE_READ in ("batched", "block") and device_rows:
        batch = _device_masses(
            [rows[r] for r in device_rows], [ids_of[r] for r in device_rows], block=DEVICE_READ == "block"
        )
        masses = dict(zip(device_rows, batch, strict=True))
    out = []
    for r, (logits, ids, t) in enumerate(zip(rows, ids_of, temperatures, strict=True)):
        if on_device[r] and r not in masses:  # "per_row"
            index = torch.tensor(ids, dtype=torch.long, device=logits.device)
            masses[r] = _device_mass(logits, logits.detach().index_select(0, index))
        if on_device[r]:
            m, total, letter_logits = masses[r]
        else:
            index = torch.tensor(ids, dtype=torch.long, device=logits.device)
            letter_logits = logits.detach().index_select(0, index).cpu().tolist()
        mass = None
        if coverage:
            mass = (m, total) if on_device[r] else _host_mass(logits)
        out.append(_letter_readout(ids, letter_logits, t, mass))
    return out


def _letter_readout(
    ids: list[int], letter_logits: Sequence[float], temperature: float, mass: tuple[float, float] | None
) -> LetterReadout:
    """`readout_from_letter_logits` of checked ids and temperature, made once with its coverage
    from the row's (max, sum exp(x - max)) when `mass` is given: the host part of a read-out after
    the copy back, while the answer waits."""
    values = _check_letter_logits(letter_logits)
    cov = None
    if mass is not None:
        m, total = mass
        # A ratio of sums shifted by the vocabulary max, rather than exp(lse_letters − lse_all):
        # the difference of two large logsumexps loses ~|lse|·1e-16 absolute precision.
        cov = min(1.0, math.fsum(math.exp(x - m) for x in values) / total)
    t = float(temperature)
    return LetterReadout(tuple(ids), tuple(values), t, _softmax(values, t), cov)


def _host_mass(logits: torch.Tensor) -> tuple[float, float]:
    """(max, sum exp(x - max)) of a row on the host in fp64. On the host: CUDA's cumsum is a
    parallel scan whose adds can combine in a different order from one run to the next (seen on
    an H200: the last bit of coverage moved)."""
    wide = logits.detach().to(device="cpu", dtype=torch.float64)
    m = float(wide.max().item())
    # A running sum (cumsum) adds in index order on every thread count; torch.sum splits a
    # CPU reduction by the number of threads, which moves the last bit of coverage.
    return m, float(torch.exp(wide - m).cumsum(0)[-1].item())


def _device_mass(logits: torch.Tensor, letters: torch.Tensor) -> tuple[float, float, list[float]]:
    """(max, sum exp(x - max), the letters' logits) of a CUDA row: the sum reduced on the device
    in a fixed order (`engine.kernels.vocab_mass`), its partials and the letters fetched in one
    copy and folded here exactly - not the whole row copied and summed on the host."""
    from engine.kernels.vocab_mass import vocab_partials

    parts = vocab_partials(logits.detach())
    host = torch.cat([parts.flatten(), letters.to(torch.float64)]).tolist()
    n = parts.numel()
    m, total = _fold_flat(host, 0, n)
    return m, total, host[n:]


# Letter-id index tensors already on a device, per (device, ids): a stage's letter lists are a
# few fixed ones (`Prompts.letter_token_ids(n)`), so after a list's first read no upload is queued.
# Bounded: past _LETTER_INDEX_MAX lists a new one is uploaded for its call only.
_LETTER_INDEX: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
_LETTER_INDEX_MAX = 512


def _letter_index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 `ids` on `device`. A list kept for later reads is uploaded with a blocking copy
    (once), so any stream may read it; one that is not kept goes up without a sync."""
    key = (device, tuple(ids))
    index = _LETTER_INDEX.get(key)
    if index is not None:
        return index
    host = torch.tensor(key[1], dtype=torch.long)
    if len(_LETTER_INDEX) >= _LETTER_INDEX_MAX:
        return host.to(device, non_blocking=True)
    index = _LETTER_INDEX[key] = host.to(device)
    return index


def _fold_spans(
    parts: list[float], letters: list[float], spans: Sequence[tuple[int, int, int, int]]
) -> list[tuple[float, float, list[float]]]:
    """Per row (its partials parts[lo:hi], its letters letters[k0:k1]): (max, sum, letters)."""
    return [(*_fold_flat(parts, lo, hi), letters[k0:k1]) for lo, hi, k0, k1 in spans]


def _pass_masses(
    block: torch.Tensor, index: Sequence[int], letter_ids: Sequence[Sequence[int]]
) -> list[tuple[float, float, list[float]]] | None:
    """`_device_masses` of rows of a block whose pass made their numbers itself (the one-pass
    body's `PassReads`: the same partials program and gather, run inside the pass's graph and
    copied back with it), folded here; None when it did not, or a later pass overwrote them."""
    from engine.kernels.attached import attached
    from engine.kernels.vocab_mass import ReadsTicket

    ticket = attached(block, ReadsTicket)
    values = None if ticket is None else ticket.values(index, letter_ids)
    if values is None:
        return None
    return [(*_fold_flat(parts, 0, len(parts)), letters) for parts, letters in values]


def _block_masses(
    block: torch.Tensor, index: Sequence[int], letter_ids: Sequence[Sequence[int]]
) -> list[tuple[float, float, list[float]]]:
    """`_device_masses` ("block" form) of the rows `index` of one fp32 block: the whole block's
    partials in one launch (each row's own bits: `vocab_partials_rows`), each row's letters
    gathered after them, one copy back into pinned memory."""
    from engine.kernels.vocab_mass import CHUNK, FIELDS, vocab_partials_rows

    n, width = block.shape
    per_row = -(-width // CHUNK) * FIELDS
    parts_size, n_letters = n * per_row, sum(len(ids) for ids in letter_ids)
    buf = torch.empty(parts_size * 8 + n_letters * 4, dtype=torch.uint8, device=block.device)
    parts, letters = buf[: parts_size * 8].view(torch.float64), buf[parts_size * 8 :].view(torch.float32)
    vocab_partials_rows(block.detach(), out=parts.view(n, -1, FIELDS))
    spans, k = [], 0
    for r, ids in zip(index, letter_ids, strict=True):
        index_ids = _letter_index(ids, block.device)
        torch.index_select(block[r].detach(), 0, index_ids, out=letters[k : k + len(ids)])
        spans.append((r * per_row, (r + 1) * per_row, k, k + len(ids)))
        k += len(ids)
    if buf.is_cuda:
        host = torch.empty(buf.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(buf, non_blocking=True)
        torch.cuda.current_stream(buf.device).synchronize()
    else:
        host = buf
    parts_host = host[: parts_size * 8].view(torch.float64).tolist()
    letters_host = host[parts_size * 8 :].view(torch.float32).tolist()
    return _fold_spans(parts_host, letters_host, spans)


def _device_masses(
    rows: Sequence[torch.Tensor], letter_ids: Sequence[Sequence[int]], *, block: bool = False
) -> list[tuple[float, float, list[float]]]:
    """`_device_mass` of every row (one device), the same values: every row's partials (the same
    kernel over the same row) and letters written into one buffer, and one copy back (`block`:
    rows of one fp32 block in `_block_masses`' form, where they are). Rows of a block whose pass
    made their numbers (`_pass_masses`) launch nothing: the numbers are folded from the host.

    What runs after the pass, per row: the partials kernel and one gather of the letters (their
    ids already on the device, `_letter_index`). Where every row is fp32 the gather writes fp32
    straight into the buffer's tail (bytes: fp64 partials, then fp32 letters; an fp32 value is
    the same Python float either way), else it is copied into fp64 there (a second kernel)."""
    from engine.kernels.vocab_mass import CHUNK, FIELDS, vocab_partials

    device = rows[0].device
    found = block_rows(rows)
    if found is not None and (made := _pass_masses(*found, letter_ids)) is not None:
        return made
    if block and found is not None:
        return _block_masses(*found, letter_ids)
    if any(x.device != device for x in rows):
        return [
            _device_mass(x, x.detach().index_select(0, _letter_index(ids, x.device)))
            for x, ids in zip(rows, letter_ids, strict=True)
        ]
    sizes = [-(-x.numel() // CHUNK) * FIELDS for x in rows]
    parts_size, n_letters = sum(sizes), sum(len(ids) for ids in letter_ids)
    narrow = all(x.dtype == torch.float32 for x in rows)
    if narrow:
        buf = torch.empty(parts_size * 8 + n_letters * 4, dtype=torch.uint8, device=device)
        parts, letters = buf[: parts_size * 8].view(torch.float64), buf[parts_size * 8 :].view(torch.float32)
    else:
        buf = torch.empty(parts_size + n_letters, dtype=torch.float64, device=device)
        parts, letters = buf[:parts_size], buf[parts_size:]
    spans = []  # per row: its partials in parts, its letters in letters
    at = k = 0
    for x, size, ids in zip(rows, sizes, letter_ids, strict=True):
        x = x.detach()
        spans.append((at, at + size, k, k + len(ids)))
        vocab_partials(x, out=parts[at : at + size].view(-1, FIELDS))
        index = _letter_index(ids, device)
        if narrow:
            torch.index_select(x, 0, index, out=letters[k : k + len(ids)])
        else:
            letters[k : k + len(ids)].copy_(x.index_select(0, index))
        at, k = at + size, k + len(ids)
    host = buf.cpu()  # the one copy back (and sync)
    if narrow:
        parts_host = host[: parts_size * 8].view(torch.float64).tolist()
        letters_host = host[parts_size * 8 :].view(torch.float32).tolist()
    else:
        values = host.tolist()
        parts_host, letters_host = values[:parts_size], values[parts_size:]
    return _fold_spans(parts_host, letters_host, spans)


def fold_vocab_mass(chunks: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(max, sum_v exp(x_v - max)) of a row from its per-chunk (max m_c, sum s_c of
    exp(x - m_c), NaN count, +inf count): max of the m_c, then math.fsum of s_c exp(m_c - max)
    (correctly rounded: the fold adds no order dependence). Raises on NaN or +inf logits."""
    return _fold(
        [c[0] for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks], [c[3] for c in chunks]
    )


def _fold_flat(values: Sequence[float], lo: int, hi: int) -> tuple[float, float]:
    """`fold_vocab_mass` of the chunks values[lo:hi], FIELDS (4) numbers a chunk back to back, as
    a device read-out copies them (strided slices: no list per chunk)."""
    return _fold(values[lo:hi:4], values[lo + 1 : hi : 4], values[lo + 2 : hi : 4], values[lo + 3 : hi : 4])


def _fold(
    maxes: Sequence[float], sums: Sequence[float], nan_counts: Sequence[float], posinf_counts: Sequence[float]
) -> tuple[float, float]:
    if any(nan_counts):
        raise ValueError(f"logits contain {sum(int(c) for c in nan_counts)} NaN value(s)")
    if any(posinf_counts):
        raise ValueError("logits contain +inf")
    m, ninf, exp = max(maxes), float("-inf"), math.exp
    if m == ninf:
        raise ValueError("logits are all -inf: no mass to read")
    return m, math.fsum([s * exp(c - m) for c, s in zip(maxes, sums, strict=True) if c != ninf])


def mix_probabilities(first: Sequence[float], second: Sequence[float], weight: float) -> tuple[float, ...]:
    """AutoThink mixing: (1 − weight)·first + weight·second. weight 1.0 returns `second`."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0.0 <= weight <= 1.0:
        raise ValueError(f"mixing weight must be in [0, 1], got {weight!r}")
    a = check_probabilities("first read-out", first)
    b = check_probabilities("second read-out", second)
    if len(a) != len(b):
        raise ValueError(f"read-outs differ in length: {len(a)} vs {len(b)}")
    if weight == 1.0:
        return tuple(b)
    if weight == 0.0:
        return tuple(a)
    return tuple((1.0 - weight) * x + weight * y for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------
# rounds: choice questions with more than 26 options


def needs_rounds(n_options: int) -> bool:
    return n_options > MAX_LETTERS


def _partition(candidates: Sequence[int]) -> list[list[int]]:
    """The fewest contiguous groups of at most GROUP_SIZE, sizes differing by at most one
    (larger groups first). Balanced rather than 25, 25, ..., remainder: a trailing group of
    one or two options would send them to the final unopposed."""
    n = len(candidates)
    k = -(-n // GROUP_SIZE)
    base, extra = divmod(n, k)
    groups, start = [], 0
    for g in range(k):
        size = base + (1 if g < extra else 0)
        groups.append(list(candidates[start : start + size]))
        start += size
    return groups


def plan_rounds(options: Sequence[str]) -> list[list[int]]:
    """First-round groups of option indices, in the given order.

    Up to 26 options: one group holding all of them (a single read is the final). More:
    ceil(n / 25) contiguous groups of near-equal size, each at most 25.
    """
    names = list(options)
    if not names:
        raise ValueError("options is empty: a choice needs at least one option")
    if len(set(names)) != len(names):
        dupes = sorted({o for o in names if names.count(o) > 1})
        raise ValueError(f"duplicate options {dupes}")
    n = len(names)
    return [list(range(n))] if not needs_rounds(n) else _partition(range(n))


def _check_groups(groups: Sequence[Sequence[int]], group_probabilities: Sequence[Sequence[float]]):
    if not groups:
        raise ValueError("no groups")
    if len(groups) != len(group_probabilities):
        raise ValueError(f"{len(groups)} groups but {len(group_probabilities)} group read-outs")
    seen: set[int] = set()
    probs = []
    for g, (members, p) in enumerate(zip(groups, group_probabilities, strict=True)):
        if not members:
            raise ValueError(f"group {g} is empty")
        if len(members) != len(p):
            raise ValueError(f"group {g} has {len(members)} options but {len(p)} probabilities")
        if seen.intersection(members) or len(set(members)) != len(members):
            raise ValueError(f"group {g} repeats an option index")
        seen.update(members)
        probs.append(check_probabilities(f"group {g}", p))
    return probs


def _group_top(probabilities: Sequence[float]) -> list[int]:
    """Positions of a group's finalists (top 3 by probability, ties → earlier), in display order."""
    order = sorted(range(len(probabilities)), key=lambda i: (-probabilities[i], i))
    return sorted(order[:FINALISTS_PER_GROUP])


def select_finalists(
    groups: Sequence[Sequence[int]], group_probabilities: Sequence[Sequence[float]]
) -> list[int]:
    """Option indices going to the final: each group's top 3 (ties → earlier option), kept
    in display order (group by group, order within the group)."""
    probs = _check_groups(groups, group_probabilities)
    return [groups[g][i] for g, p in enumerate(probs) for i in _group_top(p)]


def combine_rounds(
    groups: Sequence[Sequence[int]],
    group_probabilities: Sequence[Sequence[float]],
    final_probabilities: Sequence[float],
) -> list[float]:
    """Probabilities for every option of `groups`, aligned with the groups concatenated.

    Notation: q_g(o) is o's probability in its group's read-out (sums to 1 over group g);
    F_g is the group's finalists (`select_finalists`); r(f) is f's probability in the final
    read-out over all finalists (sums to 1), aligned with `select_finalists(...)`.

        rate     ρ_g  = min over f in F_g with q_g(f) > 0 of  r(f) / q_g(f)
        strength s(f) = r(f)                     for a finalist f
                 s(o) = ρ_g · q_g(o)             for a non-finalist o of group g
        p(o)    = s(o) / Z,   Z = 1 + ε,   ε = Σ_g ρ_g · (1 − Σ_{f in F_g} q_g(f))

    So the finalists keep their final-round probability scaled by the finalists' share 1/Z,
    and the non-finalists share ε/Z in proportion to their group score.

    Why: if each option had a fixed strength w and every read-out were w normalised over the
    options shown (a Luce model, which a softmax of context-free logits is), then
    r(f)/q_g(f) = W(G_g)/W(F) for every finalist of g, s(o) = w(o)/W(F) exactly, and p is w
    normalised over all options: uniform strengths give exactly uniform p. Real read-outs
    are not exactly Luce; the minimum takes the most conservative rate, which guarantees
    s(o) <= r(f) for every finalist f of o's group.

    Guarantees (float64): sums to 1 within 1e-12; within a group the non-finalists keep their
    group order and each is strictly below every finalist of its group; finalists keep their
    final-round order; so the argmax (ties → display order) is the final round's; every
    option is > 0 (an underflowed value is floored at the smallest normal float64).
    """
    probs = _check_groups(groups, group_probabilities)
    finals_at = [_group_top(p) for p in probs]
    n_final = sum(len(f) for f in finals_at)
    r_all = check_probabilities("final round", final_probabilities)
    if len(r_all) != n_final:
        raise ValueError(f"the final round has {n_final} finalists but {len(r_all)} probabilities")

    strengths: list[list[float]] = []
    k = 0
    for q, tops in zip(probs, finals_at, strict=True):
        r = {i: r_all[k + j] for j, i in enumerate(tops)}
        k += len(tops)
        rates = [r[i] / q[i] for i in tops if q[i] > 0.0]
        rho = min(rates) if rates else 0.0
        strengths.append([r[i] if i in r else rho * q[i] for i in range(len(q))])
    z = math.fsum(s for group in strengths for s in group)
    out: list[float] = []
    for s_group, tops in zip(strengths, finals_at, strict=True):
        p = [max(s / z, _TINY) for s in s_group]
        # Rounding (ρ·q and the division by Z) could lift a non-finalist onto a finalist of its
        # group; keep it strictly below, as the exact formula has it.
        ceiling = math.nextafter(min(p[i] for i in tops), 0.0)
        finalist = set(tops)
        out.extend(v if i in finalist else min(v, ceiling) for i, v in enumerate(p))
    return out


@dataclass(frozen=True)
class RoundStage:
    """One stage of a rounds run, for the decision record: the groups read (option indices,
    display order) and their read-outs. The last stage is the final (a single group)."""

    groups: tuple[tuple[int, ...], ...]
    readouts: tuple[LetterReadout, ...]
    final: bool


@dataclass
class ChoiceRounds:
    """Drives a choice question through its read-outs; works for any number of options.

    Up to 26 options: a single stage, one group with every option. More: first-round groups
    (`plan_rounds`), then each group's top 3 go on. If the finalists still exceed 26
    (more than 8 groups, i.e. over 200 options), they are grouped again the same way;
    otherwise they form the final. Probabilities are then combined back level by level with
    `combine_rounds`, so the final read-out's argmax is the answer.

    The engine calls `pending()` for the groups to read (it may batch them with other
    questions' reads), renders each group's options in the given order as A, B, ..., and
    hands the read-outs back through `submit()` in the same order.
    """

    n_options: int
    stages: list[RoundStage] = field(default_factory=list)
    _pending: list[list[int]] = field(default_factory=list, repr=False)
    _pending_final: bool = field(default=False, repr=False)
    _probabilities: list[float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.n_options, bool) or not isinstance(self.n_options, int) or self.n_options < 1:
            raise ValueError(f"n_options must be a positive int, got {self.n_options!r}")
        self._schedule(list(range(self.n_options)))

    def _schedule(self, candidates: list[int]) -> None:
        if needs_rounds(len(candidates)):
            self._pending, self._pending_final = _partition(candidates), False
        else:
            self._pending, self._pending_final = [candidates], True

    @property
    def done(self) -> bool:
        return self._probabilities is not None

    def pending(self) -> list[list[int]]:
        """Groups (option indices in display order) to read next; empty when done."""
        return [list(g) for g in self._pending]

    def submit(self, readouts: Sequence[LetterReadout]) -> None:
        if self.done:
            raise ValueError("all rounds are already read")
        if len(readouts) != len(self._pending):
            raise ValueError(f"expected {len(self._pending)} read-outs, got {len(readouts)}")
        for g, (group, ro) in enumerate(zip(self._pending, readouts, strict=True)):
            if len(ro.probabilities) != len(group):
                raise ValueError(
                    f"group {g} has {len(group)} options but its read-out has {len(ro.probabilities)} letters"
                )
        stage = RoundStage(tuple(tuple(g) for g in self._pending), tuple(readouts), self._pending_final)
        self.stages.append(stage)
        if stage.final:
            self._pending = []
            self._probabilities = self._combine()
        else:
            self._schedule(select_finalists(stage.groups, [r.probabilities for r in stage.readouts]))

    def _combine(self) -> list[float]:
        final = self.stages[-1]
        p = dict(zip(final.groups[0], final.readouts[0].probabilities, strict=True))
        for stage in reversed(self.stages[:-1]):
            group_probs = [r.probabilities for r in stage.readouts]
            finalists = select_finalists(stage.groups, group_probs)
            combined = combine_rounds(stage.groups, group_probs, [p[i] for i in finalists])
            p = dict(zip((i for g in stage.groups for i in g), combined, strict=True))
        return [p[i] for i in range(self.n_options)]

    @property
    def probabilities(self) -> list[float]:
        if self._probabilities is None:
            raise ValueError("rounds not finished: read the pending groups first")
        return list(self._probabilities)

    @property
    def final_choice(self) -> int:
        """Option index the final read-out ranks first (ties → display order)."""
        if self._probabilities is None:
            raise ValueError("rounds not finished: read the pending groups first")
        final = self.stages[-1]
        return final.groups[0][final.readouts[0].top]


def run_choice_rounds(
    n_options: int, read: Callable[[list[list[int]]], Sequence[LetterReadout]]
) -> ChoiceRounds:
    """Run every stage with `read(groups) -> one read-out per group` until done."""
    rounds = ChoiceRounds(n_options)
    while not rounds.done:
        rounds.submit(read(rounds.pending()))
    return rounds
