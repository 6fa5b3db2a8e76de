"""Per-chunk partials of a logits row's softmax mass, on the device, independent of the layout.

A read-out's coverage needs sum_v exp(x_v - max) over the whole vocabulary (248,320 entries
for StartLux): copying the row to the host and summing it there in fp64 cost ~4 ms per question
on the CPU, more than the forward pass it follows. Here program c reduces the CHUNK entries
[c * CHUNK, (c + 1) * CHUNK) of one row: its max m_c (NaN entries left out), its sum
s_c = sum exp(x - m_c), and its counts of NaN and +inf entries. The host folds the few partials
exactly (`engine.decide.readout.fold_vocab_mass`: math.fsum of s_c exp(m_c - m)).

Why the sum is taken in integers: an fp64 `tl.sum` is a tree whose shape follows the register
layout Triton picks, and Triton picks it from the pointer's alignment. On an H200 the same row
gave different s_c bits at a 16-byte aligned address than at an 8-byte aligned one (a row in the
middle of a logits block): the coverage depended on where the batch put the row. Each term
exp(x - m_c) lies in [0, 1], so it is split into two 40-bit fixed-point limbs (hi = floor(t 2^40),
lo = floor((t 2^40 - hi) 2^40), both exact fp64 -> int64 conversions) and the limbs are added as
int64 (at most 4096 * 2^40 < 2^53 each: no overflow, and exact when converted back). Integer
addition is associative, so s_c = hi_sum 2^-40 + lo_sum 2^-80 has the same bits whatever the
reduction tree, the address, the batch or the interpreter; its error is below 2^-80 per term
plus one rounding, i.e. tighter than the fp64 tree it replaces. The max and the counts were
already exact (max is associative; counts are small integers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels._triton import Backend, cdiv, kernel, use_triton

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

CHUNK = 4096
NUM_WARPS = 8
FIELDS = 4  # per chunk: max, sum of exp(x - max), NaN count, +inf count


def _vocab_mass_kernel(x_ptr, out_ptr, V, stride_x, stride_out, CHUNK: tl.constexpr, ON_GPU: tl.constexpr):
    c = tl.program_id(0)
    row = tl.program_id(1)  # rows of a block (`vocab_partials_rows`); one row: 0
    x_ptr += row.to(tl.int64) * stride_x
    out_ptr += row.to(tl.int64) * stride_out
    offs = c * CHUNK + tl.arange(0, CHUNK)
    inside = offs < V
    x = tl.load(x_ptr + offs, mask=inside, other=float("-inf")).to(tl.float64)
    nan = x != x
    x = tl.where(nan, float("-inf"), x)
    m = tl.max(x, axis=0)
    # an all -inf chunk sums to 0 (not NaN); one holding +inf is refused by the host, so its
    # terms are zeroed here rather than cast from inf to int64 (undefined)
    shift = tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)
    t = tl.where(m == float("inf"), 0.0, tl.exp(x - shift)) * 1099511627776.0  # 2^40: exact
    hi = t.to(tl.int64)  # t >= 0: truncation is floor
    lo = ((t - hi.to(tl.float64)) * 1099511627776.0).to(tl.int64)
    s = tl.sum(hi, axis=0).to(tl.float64) * 9.094947017729282e-13  # 2^-40
    s += tl.sum(lo, axis=0).to(tl.float64) * 8.271806125530277e-25  # 2^-80
    posinf = tl.sum((x == float("inf")).to(tl.int32), axis=0).to(tl.float64)
    tl.store(out_ptr + c * 4, m)
    tl.store(out_ptr + c * 4 + 1, s)
    tl.store(out_ptr + c * 4 + 2, tl.sum(nan.to(tl.int32), axis=0).to(tl.float64))
    tl.store(out_ptr + c * 4 + 3, posinf)


_kernel = kernel(_vocab_mass_kernel)


def vocab_partials(
    logits: torch.Tensor, *, backend: Backend = "triton", out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp64 [ceil(V / CHUNK), FIELDS] partials of a 1-D float logits row, on its device (written
    into `out` when given: a contiguous fp64 tensor of that shape, e.g. a slice of one buffer that
    several rows' read-outs share and copy back at once)."""
    if logits.dim() != 1 or not logits.is_floating_point() or logits.numel() == 0:
        raise ValueError(
            f"logits must be a non-empty 1-D float tensor, got {logits.dtype} {tuple(logits.shape)}"
        )
    # one row of a block: `vocab_partials_rows` checks `out` and launches the same program
    rows_out = None if out is None else out.unsqueeze(0)
    got = vocab_partials_rows(logits.unsqueeze(0), backend=backend, out=rows_out)
    return got[0] if out is None else out


def vocab_partials_rows(
    logits: torch.Tensor, *, backend: Backend = "triton", out: torch.Tensor | None = None
) -> torch.Tensor:
    """`vocab_partials` of every row of a 2-D float block in one launch: fp64 [rows, chunks,
    FIELDS] (into `out` when given: contiguous, that shape). The same per-chunk program as one
    row's, and a chunk's partials do not depend on the row's address (module docstring): each
    row's partials are the bits `vocab_partials` gives it alone."""
    if logits.dim() != 2 or not logits.is_floating_point() or logits.shape[1] == 0:
        raise ValueError(
            f"logits must be a 2-D float tensor with columns, got {logits.dtype} {tuple(logits.shape)}"
        )
    rows, v = logits.shape
    chunks = cdiv(v, CHUNK)
    if out is not None and (
        out.shape != (rows, chunks, FIELDS)
        or out.dtype != torch.float64
        or out.device != logits.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous fp64 [{rows}, {chunks}, {FIELDS}] tensor on {logits.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if out is None:
        out = torch.empty(rows, chunks, FIELDS, dtype=torch.float64, device=logits.device)
    if rows == 0:
        return out
    if not use_triton(backend, logits):
        for r in range(rows):
            out[r].copy_(vocab_partials_reference(logits[r]))
        return out
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    _kernel[(chunks, rows)](x, out, v, x.stride(0), chunks * FIELDS, CHUNK=CHUNK, num_warps=NUM_WARPS)
    return out


def vocab_partials_reference(logits: torch.Tensor) -> torch.Tensor:
    """The same partials in torch ops, chunk by chunk (a sequential sum: rounding differs)."""
    x = logits.detach().to("cpu", torch.float64)
    rows = []
    for lo in range(0, x.numel(), CHUNK):
        part = x[lo : lo + CHUNK]
        nan = torch.isnan(part)
        finite = part.masked_fill(nan, float("-inf"))
        m = float(finite.max())
        shift = 0.0 if m == float("-inf") else m
        s = float(torch.exp(finite - shift).cumsum(0)[-1])
        rows.append([m, s, float(nan.sum()), float(torch.isposinf(part).sum())])
    return torch.tensor(rows, dtype=torch.float64)


class PassReads:
    """A fixed block's read-out numbers made by the pass that makes its logits, beside them.

    Why: after a graphed pass, a read-out's partials launch, its letter gather and its copy back
    cost the host ~0.6 ms for one row on the H100 machine's CPU (session 20, `bench_engine.py
    --wall-split`: ~65-110 us a launch), with the GPU idle; inside the pass's CUDA graph they are
    three more nodes. `compute` (captured with the pass) writes every row's `vocab_partials_rows`
    and its logits at `letter_ids` into one device buffer and copies it into a pinned host twin;
    `issue` (after each launch of the pass) returns the ticket its read-outs present. The values
    are the ones a read-out after the pass computes (the same program per row, the same gather).

    A later launch of the same pass overwrites the host twin: a ticket of an earlier generation
    gives nothing (`values` returns None) and its read-out falls back to the kernels after the pass.
    """

    def __init__(self, rows: int, vocab: int, letter_ids: Sequence[int], device: torch.device) -> None:
        if rows < 1 or vocab < 1 or not letter_ids:
            raise ValueError(f"need rows, a vocabulary and letter ids: {rows}, {vocab}, {list(letter_ids)}")
        ids = [int(i) for i in letter_ids]
        if len(set(ids)) != len(ids) or not all(0 <= i < vocab for i in ids):
            raise ValueError(f"letter ids must be distinct and in [0, {vocab}), got {ids}")
        self.rows, self.chunks, self.letter_ids = rows, cdiv(vocab, CHUNK), tuple(ids)
        self._column = {t: k for k, t in enumerate(ids)}
        parts_bytes = rows * self.chunks * FIELDS * 8
        size = parts_bytes + rows * len(ids) * 4
        self._buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self._parts = self._buffer[:parts_bytes].view(torch.float64).view(rows, self.chunks, FIELDS)
        self._letters = self._buffer[parts_bytes:].view(torch.float32).view(rows, len(ids))
        self._index = torch.tensor(ids, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.uint8, pin_memory=True) if pinned else self._buffer
        self._host_parts = self._host[:parts_bytes].view(torch.float64).view(rows, self.chunks * FIELDS)
        self._host_letters = self._host[parts_bytes:].view(torch.float32).view(rows, len(ids))
        self._copied = torch.cuda.Event() if pinned else None
        self.generation = 0

    def compute(self, logits: torch.Tensor) -> None:
        """Partials and letters of `logits` [rows, vocab] fp32, copied to the host (capturable)."""
        vocab_partials_rows(logits, out=self._parts)
        torch.index_select(logits, 1, self._index, out=self._letters)
        if self._host is not self._buffer:
            self._host.copy_(self._buffer, non_blocking=True)

    def issue(self) -> ReadsTicket:
        """After a launch of the pass (replay or eager) on the current stream: its ticket."""
        self.generation += 1
        if self._copied is not None:
            self._copied.record()
        return ReadsTicket(self, self.generation)

    def values(
        self, generation: int, index: Sequence[int], letter_ids: Sequence[Sequence[int]]
    ) -> list[tuple[list[float], list[float]]] | None:
        """Per row `index[i]`: its partials (FIELDS numbers a chunk, back to back) and its logits
        at `letter_ids[i]`; None when a later launch overwrote the pass `generation`'s numbers or
        an id is not one of `self.letter_ids`. Waits for the pass's copy back."""
        if generation != self.generation:
            return None
        columns = [[self._column.get(int(t)) for t in ids] for ids in letter_ids]
        if any(k is None for cols in columns for k in cols) or any(not 0 <= r < self.rows for r in index):
            return None
        if self._copied is not None:
            self._copied.synchronize()
        out = []
        for r, cols in zip(index, columns, strict=True):
            letters = self._host_letters[r].tolist()
            out.append((self._host_parts[r].tolist(), [letters[k] for k in cols]))  # type: ignore[index]
        return out


@dataclass(frozen=True, eq=False)
class ReadsTicket:
    """One launch's claim on a `PassReads` (`PassReads.values` of that generation)."""

    reads: PassReads
    generation: int

    def values(
        self, index: Sequence[int], letter_ids: Sequence[Sequence[int]]
    ) -> list[tuple[list[float], list[float]]] | None:
        return self.reads.values(self.generation, index, letter_ids)
