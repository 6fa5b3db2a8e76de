"""Each logits row's k largest values, their ids and the count at the cut, in two small kernels;
and the thought sampler's device part built on them (`packed_top_k`, `StepTopK`).

Why: the thought sampler (`engine.decide.sampling.sample_tokens`) needs, per row, the k largest
logits, their ids and `reach`, the count of logits >= the k-th largest (a tie straddling the cut
makes it exceed k). In torch that is two `torch.topk` stages, a comparison over the whole row, a
sum and a cat: ~1 ms of GPU time per decode step at 64 rows of StartLux's 248,320-entry
vocabulary (27B, H200), 5% of the step. Here stage 1 (grid rows x chunks) finds each CHUNK-wide
chunk's k largest and stage 2 (grid rows) merges the chunks' candidates and writes the sampler's
packed row directly (`ids | fp32 bits of the values | reach | NaN count`, int64), which it copies
to the host in one transfer.

Order and exactness: both stages select by one int64 key per logit, key = (v << 32) | (2^32 - 1 -
id), where v is the logit's fp32 bits mapped to an int32 that orders as the floats do (negative
floats get their magnitude bits flipped; -0.0 is made +0.0 first, so the two zeros tie as they do
in float comparison). Keys are unique, so "the largest key" is "the largest value, the lowest id
among equal values" - the order of a stable descending sort (`torch.argsort(-x, stable=True)`),
a stronger contract than `torch.topk`'s, which leaves the order of ties open. A round takes the
max key (an exact integer reduction: any reduction tree, layout or batch gives the same answer)
and retires that lane; k rounds give the k largest in order. The values are then read back from
the logits at the chosen ids, so their bits are the logits' own (the sign of a zero included).
NaN lanes and lanes past the vocabulary (masked by index, never by value: a real -inf logit still
counts) get the key EMPTY, below every real key; they are counted (NaN) but never selected ahead
of a real lane. A chunk with fewer than k real lanes pads its candidates with EMPTY.

Why the merged reach is exact: let v_k be the row's k-th largest value and t_c chunk c's k-th
(stage 1 also writes own_c, the count of chunk c's lanes >= t_c). No t_c exceeds v_k (that chunk
alone would hold k values > v_k). A chunk with t_c < v_k holds all its values >= v_k among its
k candidates (they rank above its k-th), so counting its candidates >= v_k counts them; a chunk
with t_c = v_k has exactly own_c values >= v_k. reach = sum over chunks of (t_c < v_k ? that
count : own_c). A chunk with fewer than k real lanes has t_c = EMPTY < v_k and all its lanes
among its candidates. A row with fewer than k non-NaN logits (possible only with NaN, k <= V)
gets id -1 and a -inf value in its missing places, and reach = its count of non-NaN logits.

Every row's outputs depend on that row alone (grid rows are independent, reductions are integer
max and integer sums), so a row gives the same bits alone or inside any batch.

Config (chosen by reasoning, not yet timed on an H200): CHUNK 4096 lanes on 8 warps (16 keys a
thread; 61 chunks of the 248,320 vocabulary, 3,904 programs at 64 rows, 61 at one row). A round
is a 64-bit max (per thread, then warp REDUX, then across warps through shared memory) and a
compare-select; stage 1 holds only its keys through the rounds (its own count is rebuilt from
what the rounds leave), which keeps it at 62 registers for sm_90: four 256-thread blocks an SM.
The merge runs one program a row on 4 warps up to 2,048 candidate slots (64 chunk slots x k
padded to 32), 8 beyond, and takes MERGE_MAX slots at most (`fits`). The last chunk of a
vocabulary CHUNK does not divide is masked by index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from engine.kernels._triton import Backend, cdiv, kernel, next_pow2, use_triton
from engine.kernels.attached import attached_rows

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

CHUNK = 4096  # lanes per stage-1 program (a power of two)
NUM_WARPS = 8  # stage 1
MERGE_WARPS = 4  # stage 2, up to MERGE_WIDE slots; 8 warps beyond
MERGE_WIDE = 2048
MERGE_MAX = 4096  # chunk slots x padded k the merge holds in registers (at most 32 keys a thread)
EMPTY = -(2**63) + 1  # the key of a lane that is not there (NaN, past the vocabulary, taken)
_LOW = 2**32 - 1


def _chunk_top_k_kernel(
    x_ptr, keys_ptr, counts_ptr, V, stride, C,
    K: tl.constexpr, KPAD: tl.constexpr, CHUNK: tl.constexpr, EMPTY: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    gid = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    inside = gid < V
    x = tl.load(x_ptr + row * stride + gid, mask=inside, other=0.0)
    real = inside & (x == x)  # NaN is not ordered: left out, counted
    nan = inside & (x != x)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0: the zeros tie, as in float comparison
    bits = x.to(tl.int32, bitcast=True)
    v = tl.where(bits < 0, bits ^ 2147483647, bits).to(tl.int64)  # orders as the floats do
    keys = tl.where(real, v * 4294967296 + (4294967295 - gid), EMPTY)
    at = row * C + c
    tl.store(counts_ptr + at * 2 + 1, tl.sum(nan.to(tl.int32), axis=0).to(tl.int64))
    slots = tl.arange(0, KPAD)
    best = tl.full([KPAD], EMPTY, tl.int64)
    for r in range(K):
        m = tl.max(keys, axis=0)
        best = tl.where(slots == r, m, best)
        keys = tl.where(keys == m, EMPTY, keys)  # keys are unique: one lane retires
    # own count (lanes >= the k-th value), from what the rounds left: every lane above the k-th
    # value was taken, so it is k plus the untaken lanes equal to it (a chunk with fewer than k
    # real lanes: its taken ones). Nothing held through the rounds but the keys.
    kth_key = tl.max(tl.where(slots == K - 1, best, EMPTY), axis=0)
    tied = tl.sum(((keys >> 32) == (kth_key >> 32)).to(tl.int32), axis=0)  # EMPTY: below any value
    taken = tl.sum((best != EMPTY).to(tl.int32), axis=0)
    own = tl.where(kth_key == EMPTY, taken, K + tied).to(tl.int64)
    tl.store(keys_ptr + at * K + slots, best, mask=slots < K)
    tl.store(counts_ptr + at * 2, own)


def _merge_top_k_kernel(
    x_ptr, keys_ptr, counts_ptr, out_ptr, stride, C,
    K: tl.constexpr, KPAD: tl.constexpr, CPAD: tl.constexpr, EMPTY: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, CPAD)
    js = tl.arange(0, KPAD)
    chunk_in = cs < C
    inside = chunk_in[:, None] & (js[None, :] < K)
    cand = keys_ptr + row * C * K + cs[:, None] * K + js[None, :]
    keys = tl.load(cand, mask=inside, other=EMPTY)
    best = tl.full([KPAD], EMPTY, tl.int64)
    for r in range(K):
        m = tl.max(tl.max(keys, axis=1), axis=0)
        best = tl.where(js == r, m, best)
        keys = tl.where(keys == m, EMPTY, keys)
    vk = tl.max(tl.where(js == K - 1, best, EMPTY), axis=0) >> 32
    valid = (js < K) & (best != EMPTY)
    ids = tl.where(valid, 4294967295 - (best & 4294967295), -1)
    values = tl.load(x_ptr + row * stride + ids, mask=valid, other=float("-inf"))
    bits = values.to(tl.int32, bitcast=True).to(tl.int64)  # sign-extended, as the sampler reads them
    # reach: per chunk, its candidates >= v_k where its own k-th is below v_k, else its own count
    above = tl.sum((inside & ((tl.load(cand, mask=inside, other=EMPTY) >> 32) >= vk)).to(tl.int32), axis=1)
    kth = tl.load(keys_ptr + row * C * K + cs * K + (K - 1), mask=chunk_in, other=EMPTY) >> 32
    own = tl.load(counts_ptr + (row * C + cs) * 2, mask=chunk_in, other=0)
    reach = tl.sum(tl.where(chunk_in & (kth < vk), above.to(tl.int64), own), axis=0)
    nan = tl.sum(tl.load(counts_ptr + (row * C + cs) * 2 + 1, mask=chunk_in, other=0), axis=0)
    out = out_ptr + row * (2 * K + 2)
    tl.store(out + js, ids, mask=js < K)
    tl.store(out + K + js, bits, mask=js < K)
    tl.store(out + 2 * K, reach)
    tl.store(out + 2 * K + 1, nan)


_chunk_kernel = kernel(_chunk_top_k_kernel)
_merge_kernel = kernel(_merge_top_k_kernel)


class TopK(NamedTuple):
    """A packed result unpacked: fp32 values [n, k] (descending), int64 ids [n, k] (lowest id first
    among equal values; -1 where a row has fewer than k non-NaN logits), reach [n], NaN count [n]."""

    values: torch.Tensor
    ids: torch.Tensor
    reach: torch.Tensor
    nan: torch.Tensor


def fits(vocab: int, k: int, chunk: int | None = None) -> bool:
    """Whether `row_top_k` takes rows of `vocab` logits with this k and chunk (None: CHUNK):
    1 <= k <= vocab, k <= chunk (stage 1 keeps k of a chunk's lanes), chunk a power of two, and
    the merge's chunk slots x k, each padded to a power of two, within MERGE_MAX (its registers)."""
    chunk = CHUNK if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1) or not 1 <= k <= min(vocab, chunk) or vocab >= 2**31:
        return False
    return next_pow2(cdiv(vocab, chunk)) * next_pow2(k) <= MERGE_MAX


def row_top_k(
    x: torch.Tensor, k: int, *, backend: Backend = "auto", chunk: int | None = None
) -> torch.Tensor:
    """int64 [n, 2k + 2] per row of fp32 logits x [n, vocab]: the k largest logits' ids, their fp32
    bits (sign-extended), reach (the logits >= the k-th largest) and the row's NaN count, on x's
    device (see the module docstring for the order and why it is exact; `unpack` reads it).

    `chunk` (None: CHUNK, read at the call, so a bench's `--set` or a test can change it) is the
    stage-1 width; tests use small ones to keep the interpreter fast. Every chunk gives the same
    output."""
    chunk = CHUNK if chunk is None else chunk
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 [n, vocab], got {x.dtype} {tuple(x.shape)}")
    n, vocab = x.shape
    if not fits(vocab, k, chunk):
        raise ValueError(
            f"row_top_k takes 1 <= k <= min(vocab, chunk) with chunk a power of two and "
            f"{MERGE_MAX} merge slots at most; got k={k}, vocab={vocab}, chunk={chunk}"
        )
    if not use_triton(backend, x):
        return row_top_k_reference(x, k)
    out = torch.empty(n, 2 * k + 2, dtype=torch.int64, device=x.device)
    if n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    chunks = cdiv(vocab, chunk)
    keys = torch.empty(n, chunks, k, dtype=torch.int64, device=x.device)
    counts = torch.empty(n, chunks, 2, dtype=torch.int64, device=x.device)
    kpad, cpad = next_pow2(k), next_pow2(chunks)
    _chunk_kernel[(n, chunks)](
        x, keys, counts, vocab, x.stride(0), chunks,
        K=k, KPAD=kpad, CHUNK=chunk, EMPTY=EMPTY, num_warps=NUM_WARPS,
    )  # fmt: skip
    _merge_kernel[(n,)](
        x, keys, counts, out, x.stride(0), chunks,
        K=k, KPAD=kpad, CPAD=cpad, EMPTY=EMPTY, num_warps=MERGE_WARPS if cpad * kpad <= MERGE_WIDE else 8,
    )  # fmt: skip
    return out


def row_top_k_reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """The same packed rows in torch ops (on x's device): `torch.topk` of the same unique keys,
    whose order is therefore fully determined."""
    n, vocab = x.shape
    nan = torch.isnan(x)
    bits = x.masked_fill(x == 0.0, 0.0).view(torch.int32)
    v = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    gid = torch.arange(vocab, device=x.device, dtype=torch.int64)
    keys = (v * 2**32 + (_LOW - gid)).masked_fill(nan, EMPTY)
    top = torch.topk(keys, k, dim=-1).values
    valid = top != EMPTY
    ids = torch.where(valid, _LOW - (top & _LOW), -1)
    values = x.gather(1, ids.clamp(min=0)).masked_fill(~valid, float("-inf"))
    vk = top[:, -1:] >> 32
    reach = ((v >= vk) & ~nan).sum(dim=-1, keepdim=True)
    return torch.cat([ids, values.view(torch.int32).long(), reach, nan.sum(dim=-1, keepdim=True)], dim=1)


def unpack(packed: torch.Tensor, k: int) -> TopK:
    """The fields of `row_top_k`'s packed rows (on the packed tensor's device)."""
    values = packed[:, k : 2 * k].to(torch.int32).view(torch.float32)
    return TopK(values, packed[:, :k], packed[:, 2 * k], packed[:, 2 * k + 1])


# ------------------------------------------------------------------------ the sampler's device part
# How `packed_top_k` finds each row's k largest logits on the logits' device: "torch" (two
# `torch.topk` stages, then a comparison and a sum over the rows for the count at the cut, and a
# cat: ~1 ms of GPU time per step at 64 rows of the 27B's vocabulary on an H200) or "kernel"
# (`row_top_k`: this module's two small Triton kernels, which write the same packed rows directly).
# Both give the same tokens bit for bit; "kernel" is off until it is timed on an H200
# (ops/bench/bench_engine.py's variant "tc64inv-topkkernel").
TOP_K_FORMS = ("torch", "kernel")
TOP_K_FORM = "torch"
# The kernel form's backend: "auto" runs it on CUDA logits only (elsewhere the torch form runs);
# tests set "triton" to run it through Triton's interpreter on CPU.
_TOP_K_BACKEND: Backend = "auto"


def packed_top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [n, 2k + 2] on x's device, per row: the ids of its k largest logits, their fp32 bits
    (sign-extended), reach (how many logits are >= the k-th largest) and its NaN count.

    The kernel form writes it in one pass (ids in stable-sort order); the torch form builds it
    from `_top_k` (any order among ties: the caller orders them). A shape the kernel does not
    take (`fits`) runs the torch form.
    """
    if TOP_K_FORM not in TOP_K_FORMS:
        raise ValueError(f"TOP_K_FORM must be one of {TOP_K_FORMS}, got {TOP_K_FORM!r}")
    if TOP_K_FORM == "kernel" and use_triton(_TOP_K_BACKEND, x) and fits(x.shape[1], k):
        return row_top_k(x, k, backend=_TOP_K_BACKEND)
    values, ids = _top_k(x, k)  # the k largest per row (their order among ties: any)
    reach = (x >= values[:, -1:]).sum(dim=-1, keepdim=True)  # logits >= the k-th largest
    nan = torch.isnan(x).sum(dim=-1, keepdim=True)
    return torch.cat([ids, values.view(torch.int32).long(), reach, nan], dim=1)


TOPK_SEGMENTS = 64  # a row's top-k is found per segment, then among the segments' winners


def _top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [n, vocab] and their ids, in two stages.

    Why: `torch.topk` walks a 248,320-long row with one thread block (0.16 ms for one row on an
    H200); split into TOPK_SEGMENTS segments the first stage runs one block each, and the
    second picks among n x segments x k candidates. The k largest of a row are among the k
    largest of its segments, so the values are exactly the one-stage values (which of several
    equal values is returned may differ: the caller counts the ties at the cut itself). A
    vocabulary the segments do not divide, or segments shorter than k, take the one stage.
    """
    n, vocab = x.shape
    segments = TOPK_SEGMENTS
    if vocab % segments or vocab // segments < k:
        return torch.topk(x, k, dim=-1)
    width = vocab // segments
    seg_values, seg_ids = torch.topk(x.reshape(n, segments, width), k, dim=-1)  # [n, segments, k]
    offsets = torch.arange(0, vocab, width, device=x.device).view(1, segments, 1)
    values, pick = torch.topk(seg_values.view(n, segments * k), k, dim=-1)
    return values, (seg_ids + offsets).view(n, segments * k).gather(1, pick)


class StepTopK:
    """A decode step's sampler numbers made inside the step's CUDA graph, beside its logits.

    Why: after a graphed step, the sampler's device part (`packed_top_k`: the two top-k stages,
    the counts at the cut, a cat: about ten launches) and its copy back ran on the host with the
    GPU idle, ~1 ms a step at 64 rows on the device machines (`bench_engine.py --decode-profile`,
    session 15: "sampler 1.02 ms outside the graph"; a launch there costs 60-110 us). `compute`
    (captured with the step) runs the same `packed_top_k` over the step's logits and copies its
    rows into a pinned host twin; `issue` (after each launch) returns the ticket the step's logits
    carry (`engine.kernels.attached`), where `engine.decide.sampling.sample_tokens` finds each
    row's numbers. The same function on the same logits: the same numbers, so the same tokens.

    A later launch of the same step overwrites the host twin: a ticket of an earlier generation
    gives nothing (`rows` returns None) and the sampler computes the numbers itself, as before.
    """

    def __init__(self, rows: int, k: int, device: torch.device) -> None:
        if rows < 1 or k < 1:
            raise ValueError(f"need rows >= 1 and k >= 1, got {rows}, {k}")
        self.k = k
        pinned = device.type == "cuda"
        self._host = torch.zeros(rows, 2 * k + 2, dtype=torch.int64, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None
        self.generation = 0

    def compute(self, logits: torch.Tensor) -> None:
        """`packed_top_k` of logits [n <= rows, vocab] fp32 into the host twin's first n rows
        (capturable)."""
        made = packed_top_k(logits.detach().float(), self.k)
        self._host[: made.shape[0]].copy_(made, non_blocking=self._copied is not None)

    def issue(self) -> StepTopKTicket:
        """After a launch of the step (replay or eager) on the current stream: its ticket."""
        self.generation += 1
        if self._copied is not None:
            self._copied.record()
        return StepTopKTicket(self, self.generation)

    def rows(self, generation: int) -> torch.Tensor | None:
        """The host rows [rows, 2k + 2] of launch `generation` (waits for its copy), or None when
        a later launch overwrote them."""
        if generation != self.generation:
            return None
        if self._copied is not None:
            self._copied.synchronize()
        return self._host


@dataclass(frozen=True, eq=False)
class StepTopKTicket:
    """One launch's claim on a `StepTopK` (`StepTopK.rows` of that generation)."""

    top_k: StepTopK
    generation: int

    def rows(self) -> torch.Tensor | None:
        return self.top_k.rows(self.generation)


def step_top_k_rows(rows: Sequence[torch.Tensor], k: int) -> tuple[torch.Tensor | None, list[int]]:
    """`packed_top_k` rows for `rows` that decode steps made for this k (`StepTopK`, still current):
    (a host int64 [n, 2k + 2] holding them, zeros elsewhere, or None where no row has them; the
    positions of the rows it does not hold). Rows are grouped by the block they are views of, so
    the common step - every row a row of one step's logits, in order - costs a few attribute
    reads a row and returns the host buffer's own rows."""
    n = len(rows)
    table: torch.Tensor | None = None
    held = [False] * n
    for ticket, places, indices in attached_rows(rows, StepTopKTicket):
        if ticket.top_k.k != k:
            continue
        host = ticket.rows()
        if host is None:
            continue
        index, where = [], []
        for r, i in zip(places, indices, strict=True):
            if i < host.shape[0]:
                index.append(i)
                where.append(r)
        if len(where) == n and index == list(range(n)):
            return host[:n], []
        if where:
            if table is None:
                table = torch.zeros(n, 2 * k + 2, dtype=torch.int64)
            table[where] = host[index]
            for r in where:
                held[r] = True
    return table, [r for r in range(n) if not held[r]]
