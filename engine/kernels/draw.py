"""The thought sampler's draw on the device: each row's token from its top-k numbers, in one kernel.

Why: after a 64-sequence decode step the GPU waits ~1.9 ms (8% of the step on an H100) while the
sampler's top-k runs after the replay, its numbers come back to the host and the host draws each
row's token in Python float64 (`ops/bench/NOTES-kernels.md`, session 31). With the top-k
(`engine.kernels.top_k.row_top_k`) and this draw inside the step's graph, the host reads one
token a row, and a decode loop could run steps ahead of the host. `StepDraw` is that part of a
decode step (`engine.run.decoder.DRAW_IN_STEP`; session 32, on: 64 sequences +10% on an H100).

What it computes: `engine.decide.sampling._draw` - the same float64 operations in the same order,
each an IEEE-754 basic operation (`engine.decide.portable_exp`'s exp, left-to-right sums,
float64 division, which Triton lowers to the correctly rounded `div.rn.f64`; built without
fused multiply-adds), so a row gives the host's token
bit for bit. One program a row, scalar code, three passes over its k candidates (the normaliser,
the running sums to the top-p cut, the walk to u times the head's sum), recomputing a
candidate's weight in each pass (the same operations, so the same values).

Its input is `row_top_k`'s packed row: ids in the order of a stable descending sort (value
descending, the lower id first among equal values) - the order the host's sampler puts its
candidates in, ties across the cut included, since the kernel's k are the k largest unique
(value, -id) keys. A row with NaN logits gets -1 (the host's sampler refuses such a row: its
caller falls back to it, which raises); temperature <= 0 draws the first candidate (the host's
greedy argmax, the lowest id among the maxima).

float64 constants come from a table in memory (`constants`): a Python float inside a Triton
kernel is an fp32 constant, which would round ln 2 and the Taylor coefficients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from engine.decide import portable_exp as pe
from engine.kernels._triton import Backend, helper, kernel, use_triton
from engine.kernels.attached import attached_rows
from engine.kernels.top_k import row_top_k, unpack

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None


TABLE_SIZE = 22  # `constants`' entries


def constants(temperature: float, top_p: float, device: torch.device | str) -> torch.Tensor:
    """The kernel's float64 table, at the positions its code reads (kernels cannot read module
    globals, so they are written there as numbers): 0-13 the portable exp's Taylor coefficients
    (highest degree first), 14 ln2_hi, 15 ln2_lo, 16 1/ln 2, 17 FLUSH_BELOW, 18 zero, 19 one half,
    20 the temperature, 21 top-p."""
    table = [*pe.TAYLOR, pe.LN2_HI, pe.LN2_LO, pe.INV_LN2, pe.FLUSH_BELOW, 0.0, 0.5, temperature, top_p]
    assert len(table) == TABLE_SIZE
    return torch.tensor(table, dtype=torch.float64, device=device)


def _exp(x, c_ptr):
    """`portable_exp(x)` for x <= 0 from the table at c_ptr: the same operations in the same
    order. Arguments it flushes (below FLUSH_BELOW, -inf) or passes through (NaN) are replaced
    by 0 before the reduction, so the bit-built 2^n always stays a normal number."""
    zero = tl.load(c_ptr + 18)
    flushed = x < tl.load(c_ptr + 17)
    safe = tl.where(flushed | (x != x), zero, x)
    n = tl.floor(safe * tl.load(c_ptr + 16) + tl.load(c_ptr + 19))
    r = (safe - n * tl.load(c_ptr + 14)) - n * tl.load(c_ptr + 15)
    p = tl.load(c_ptr)
    for j in tl.static_range(1, 14):
        p = p * r + tl.load(c_ptr + j)
    two_n = ((n.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)  # exact: -1021 <= n <= 0
    e = p * two_n
    return tl.where(x != x, x, tl.where(flushed, zero, e))


def _candidate(row_ptr, i, K: tl.constexpr):
    """Candidate i's logit (float64, exact from its fp32 bits) of a packed row."""
    bits = tl.load(row_ptr + K + i).to(tl.int32)
    return bits.to(tl.float32, bitcast=True).to(tl.float64)


def _weight(row_ptr, i, top, temperature, c_ptr, K: tl.constexpr):
    """exp(l_i / T - max): the candidate's unnormalised weight."""
    return _exp(_candidate(row_ptr, i, K) / temperature - top, c_ptr)


def _draw_kernel(packed_ptr, us_ptr, c_ptr, out_ptr, stride_p, K: tl.constexpr, ON_GPU: tl.constexpr):
    """Program r: the token of packed row r with the uniform us[r] (see the module docstring)."""
    r = tl.program_id(0).to(tl.int64)
    row_ptr = packed_ptr + r * stride_p
    zero = tl.load(c_ptr + 18)
    greedy = tl.load(c_ptr + 20) <= zero
    temperature = tl.where(greedy, tl.load(c_ptr + 19), tl.load(c_ptr + 20))  # greedy: any finite T
    top_p = tl.load(c_ptr + 21)
    top = _candidate(row_ptr, 0, K) / temperature
    norm = zero
    for i in range(0, K):
        norm = norm + _weight(row_ptr, i, top, temperature, c_ptr, K)
    # the running sums, stopped at the first that reaches top_p (top_p < 1): its length `keep`
    total = zero
    cut = zero != zero  # False, as a value the loop can carry
    keep = cut.to(tl.int32) + K
    for i in range(0, K):
        grown = total + _weight(row_ptr, i, top, temperature, c_ptr, K) / norm
        total = tl.where(cut, total, grown)
        reached = (~cut) & (total >= top_p) & (top_p < 1.0)
        keep = tl.where(reached, i + 1, keep)
        cut = cut | reached
    target = tl.load(us_ptr + r) * total
    # the walk: the first running sum that passes the target, else the head's last
    walked = zero
    chosen = keep - 1
    found = cut & ~cut
    for i in range(0, K):
        walked = walked + _weight(row_ptr, i, top, temperature, c_ptr, K) / norm
        hit = (~found) & (i < keep) & (target < walked)
        chosen = tl.where(hit, i, chosen)
        found = found | hit
    chosen = tl.where(greedy, 0, chosen)
    token = tl.load(row_ptr + chosen)
    token = tl.where(tl.load(row_ptr + 2 * K + 1) != 0, -1, token)
    tl.store(out_ptr + r, token)


_exp = helper(_exp)  # type: ignore[assignment]
_candidate = helper(_candidate)  # type: ignore[assignment]
_weight = helper(_weight)  # type: ignore[assignment]
_draw_rows = kernel(_draw_kernel)


def draw_tokens_reference(
    packed: torch.Tensor, us: torch.Tensor, k: int, temperature: float, top_p: float
) -> torch.Tensor:
    """The host sampler's tokens for packed top-k rows: `engine.decide.sampling._draw` over each
    row's candidates (the first candidate at temperature <= 0, -1 for a row with NaN logits),
    int64 [n] on the rows' device."""
    from engine.decide.sampling import _draw  # here: the sampler imports this module for `StepDraw`

    top = unpack(packed.cpu(), k)  # the packed row's fields, as the sampler reads them
    ids, values = top.ids.tolist(), top.values.double().tolist()
    tokens = []
    for r, (u, nan) in enumerate(zip(us.tolist(), top.nan.tolist(), strict=True)):
        if nan:
            tokens.append(-1)
        elif temperature <= 0.0:
            tokens.append(int(ids[r][0]))
        else:
            tokens.append(_draw(values[r], ids[r], u, temperature=temperature, top_p=top_p))
    return torch.tensor(tokens, dtype=torch.int64, device=packed.device)


def draw_tokens(
    packed: torch.Tensor,
    us: torch.Tensor,
    k: int,
    temperature: float,
    top_p: float,
    *,
    table: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Each row's token (int64 [n]) from `row_top_k`'s packed rows int64 [n, 2k + 2] and its
    uniform us float64 [n], as `draw_tokens_reference` gives it. `table`: `constants(temperature,
    top_p)` made once on the rows' device (a captured graph keeps its address); None makes it."""
    if packed.dim() != 2 or packed.dtype != torch.int64 or packed.shape[1] != 2 * k + 2 or k < 1:
        raise ValueError(
            f"packed must be int64 [n, 2k + 2] with k >= 1, got {packed.dtype} {tuple(packed.shape)}, k={k}"
        )
    if us.shape != (packed.shape[0],) or us.dtype != torch.float64 or us.device != packed.device:
        raise ValueError(
            f"us must be float64 [{packed.shape[0]}] on {packed.device}, got {us.dtype} {tuple(us.shape)}"
        )
    if not use_triton(backend, packed):
        return draw_tokens_reference(packed, us, k, temperature, top_p)
    if table is None:
        table = constants(temperature, top_p, packed.device)
    if table.dtype != torch.float64 or table.shape != (TABLE_SIZE,) or table.device != packed.device:
        raise ValueError(f"table must be `constants(...)`: float64 [{TABLE_SIZE}] on {packed.device}")
    if packed.stride(1) != 1:
        packed = packed.contiguous()
    out = torch.empty(packed.shape[0], dtype=torch.int64, device=packed.device)
    if packed.shape[0]:
        _draw_rows[(packed.shape[0],)](
            packed, us.contiguous(), table, out, packed.stride(0), K=k, num_warps=1, enable_fp_fusion=False
        )
    return out


# ------------------------------------------------------------------------ the draw inside a step
# Where `StepDraw` runs its two kernels: "auto" on CUDA logits (the torch references elsewhere);
# tests set "triton" to run them through Triton's interpreter on CPU.
_STEP_BACKEND: Backend = "auto"


class DrawSettings(NamedTuple):
    """The thought sampler's settings a step draws with (`engine.decide.decision_config`'s
    thought_top_k, thought_temperature, thought_top_p)."""

    top_k: int
    temperature: float
    top_p: float


class StepDraw:
    """A decode step's thought draws made inside the step's CUDA graph, beside its logits.

    Why: with `engine.kernels.top_k.StepTopK` the step already makes the sampler's top-k numbers,
    but the host still copies them back and draws 64 rows in Python float64 (~0.5 ms a step on
    the device host, the GPU idle). Here the step also draws: `load` puts each row's uniform for
    its next draw in a static device tensor before the launch, `compute` (captured with the step)
    runs `row_top_k` and `draw_tokens` over the step's logits into the device tensor `into` (the
    decoder's feed: a next step can take its token from there without the host), and `issue`
    (after each launch) copies them into a pinned host slot and returns the ticket the step's
    logits carry (`engine.kernels.attached`). `engine.decide.sampling.sample_tokens` takes a row's
    token from there only where the ticket's settings and the row's uniform are exactly the ones
    it was asked to draw with; every other row (a thought's first draw, a NaN row, a launch more
    than RING launches back) is drawn on the host as before. The same operations on the same
    candidates: the same token.
    """

    RING = 2  # host slots: a launch's tokens stay readable while the next launch runs

    def __init__(self, rows: int, settings: DrawSettings, into: torch.Tensor) -> None:
        if rows < 1 or settings.top_k < 1 or settings.temperature <= 0.0:
            raise ValueError(f"need rows >= 1, top_k >= 1 and temperature > 0, got {rows}, {settings}")
        if into.dtype != torch.int64 or into.dim() != 1 or into.shape[0] < rows:
            raise ValueError(f"into must be int64 [>= {rows}], got {into.dtype} {tuple(into.shape)}")
        device = into.device
        self.settings = settings
        self.into = into
        self.uniforms = torch.zeros(rows, dtype=torch.float64, device=device)  # loaded before each launch
        self.table = constants(settings.temperature, settings.top_p, device)
        pinned = device.type == "cuda"
        self._host = torch.zeros(self.RING, rows, dtype=torch.int64, pin_memory=pinned)
        self._copied = [torch.cuda.Event() for _ in range(self.RING)] if pinned else None
        self._loaded: tuple[float | None, ...] = ()
        self.generation = 0

    def load(self, us: Sequence[float | None]) -> None:
        """The uniforms of the next launch's rows (None: that row draws nothing; padding after)."""
        if len(us) > self.uniforms.shape[0]:
            raise ValueError(f"{len(us)} uniforms for {self.uniforms.shape[0]} rows")
        values = [0.0 if u is None else u for u in us] + [0.0] * (self.uniforms.shape[0] - len(us))
        if any(not 0.0 <= u < 1.0 for u in values):
            raise ValueError(f"uniforms must be in [0, 1), got {list(us)}")
        self.uniforms.copy_(torch.tensor(values, dtype=torch.float64), non_blocking=True)
        self._loaded = tuple(us)

    def compute(self, logits: torch.Tensor) -> None:
        """Each row's token of logits [n <= rows, vocab] fp32 with its loaded uniform, into
        `into[:n]` (capturable)."""
        k, temperature, top_p = self.settings
        packed = row_top_k(logits.detach().float(), k, backend=_STEP_BACKEND)
        n = packed.shape[0]
        tokens = draw_tokens(
            packed, self.uniforms[:n], k, temperature, top_p, table=self.table, backend=_STEP_BACKEND
        )
        self.into[:n].copy_(tokens)

    def issue(self) -> StepDrawTicket:
        """After a launch of the step (replay or eager) on the current stream: its tokens on their
        way to a host slot, and its ticket."""
        self.generation += 1
        slot = self.generation % self.RING
        n = self._host.shape[1]
        self._host[slot].copy_(self.into[:n], non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied[slot].record()
        return StepDrawTicket(self, self.generation, self._loaded)

    def tokens(self, generation: int) -> torch.Tensor | None:
        """The host tokens [rows] of launch `generation` (waits for their copy), or None when later
        launches overwrote them."""
        if not self.generation - self.RING < generation <= self.generation:
            return None
        slot = generation % self.RING
        if self._copied is not None:
            self._copied[slot].synchronize()
        return self._host[slot]


@dataclass(frozen=True, eq=False)
class StepDrawTicket:
    """One launch's claim on a `StepDraw`: its generation and the uniforms its rows drew with."""

    draw: StepDraw
    generation: int
    uniforms: tuple[float | None, ...]


def step_drawn_tokens(
    rows: Sequence[torch.Tensor], us: Sequence[float], settings: DrawSettings
) -> list[int | None]:
    """Per row, the token a decode step drew for it in its graph (`StepDraw`), where that draw
    used exactly these settings and the row's uniform us[r] and its launch is still current;
    else None (the caller draws that row itself). A token of -1 (a NaN row) is None too."""
    found: list[int | None] = [None] * len(rows)
    for ticket, places, indices in attached_rows(rows, StepDrawTicket):
        if ticket.draw.settings != settings:
            continue
        host: list[int] | None = None
        for r, i in zip(places, indices, strict=True):
            if i >= len(ticket.uniforms) or ticket.uniforms[i] != us[r]:
                continue
            if host is None:
                tokens = ticket.draw.tokens(ticket.generation)
                if tokens is None:
                    break
                host = tokens.tolist()
            if host[i] >= 0:
                found[r] = host[i]
    return found
