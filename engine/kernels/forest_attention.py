"""Gated attention for a whole-forest pass: packed prefill tokens over K/V pieces read where they lie.

The prefill counterpart of `engine.kernels.decode_attention`, reading the forest tables of
`engine.kernels.forest_tables` (one attention layer's `pieces` [S, P, 4]). Two kernels per layer:

- `forest_attention_prep`: program (packed row, head) RMS-normalises (q_norm / k_norm, per head)
  and applies partial NeoX RoPE to the row's query head, or - for the extra programs, one per KV
  head - to its key, and stores key and value at the row's local index of its segment's own K/V
  block (the last piece of its segment's table). cos/sin per row come from the host. Padding
  rows (live 0) still get a query (nobody reads it) but write nothing.
- `forest_attention`: program (query block, query head) takes the BLOCK_M consecutive tokens of
  one segment that the block covers (blocks are aligned to the segment start) and walks the
  segment's pieces in their fixed order: the ancestors oldest first (whole; an empty slot is
  skipped), then the segment's own block, causally (a token at local index l sees own keys
  0 .. l). Each piece is reduced on its own in blocks of BLOCK_L keys starting at the piece start
  (online softmax), then folded into a running (max, sum, output), exactly the cascade of
  `engine.run.reference.fold_attention_piece`; the output is multiplied by sigmoid(gate). Key blocks
  of the own piece past a token's causal limit give it only -inf scores, which leave its running
  max, sum and output bitwise unchanged. Dead query blocks return at once; rows no live block
  covers keep the zeros the host initialises `out` with.
- `_long_attention_kernel` (tensor-core dots, LONG_DOTS, segments of at least
  `LongConfig.min_length` tokens; the 16-row kernel then skips those segments): program (query
  head, block of `block_m` rows aligned to the segment start; of a long segment's 16-row records
  the one at each multiple of block_m runs it, the others return) walks the same pieces in the
  same order in tiles of `block_l` keys aligned to each piece start, with one running online
  softmax over the whole chain (base-2 exponentials). Tiles every row of the block sees in full
  run unmasked; the rest (a piece's tail, the own block's diagonal) are masked. The heads are
  the fastest grid dimension, so the G heads of one KV head read its tiles together (from L2),
  and query blocks run last first (the longest causal walks start first). An 8,192-token
  segment at 64 rows streams a quarter of the 16-row kernel's K/V traffic. K/V stay fp32 in
  storage (the prefix cache and the decoder read them). Under bf16 dots `_shadow_kernel` first
  rounds the long segments' own K/V into a transient bf16 copy [T, NKV, HD] (per call, indexed
  by packed row), which the kernel loads straight into shared memory; ancestors are rounded in
  registers as they are loaded, in tiles of `ancestor_block_l` keys. Either way a value is
  rounded to nearest even once, so the bits do not depend on which path read it.
- `_split_plan_kernel` + `_split_kernel` (bf16 dots, `SplitConfig`): a block of the 16-row
  kernel whose ancestors hold many keys (a question after long evidence) would walk them all in
  one program per head - 0.87 ms a 27B layer for one question after 8k tokens, 72 programs on
  132 SMs. The plan kernel numbers those blocks; the persistent split kernel cuts each block's
  ancestor tiles into `splits` contiguous ranges (bounds from the chain's own lengths) and
  reduces each (block, KV head, range) in its own unit, the G query heads of the KV head
  as one tile (each K/V tile loaded once for G heads); the 16-row kernel then folds the
  partials in range order and goes on with the own block. Blocks past the workspace's capacity
  run their ranges one after another in one unit (the same loop), folding as they go.

- `_fmha_plan_kernel` + the CUTLASS FMHA kernel (`FMHA_LONG_TIER`, head_dim 256, bf16 dots): the
  last tier's own causal blocks in CUTLASS's Hopper FMHA example kernel with a tile scheduler and
  an epilogue of ours (`cuda/forest_fmha_sm90.cuh`): the plan lists each long segment's 128-row
  query tiles, one launch for every head reads its queries and bf16 K/V shadow rows from the
  segment's first packed row (the KV head in the kernel's batch coordinate, the shadow laid out
  [T, NKV, HD]) and writes the normalised output and its LSE for the segment's rows only; the
  tier's `_long_attention_kernel` launch (`OWN_FMHA`, `FMHA_FOLD`'s light blocks) then walks the
  ancestors and folds that output in as one more piece.

Length tiers (`long_configs`, `LongConfig.max_length`): the large-block kernel may run once per
tier of segment lengths, each tier with its own block config (short evidence in smaller blocks,
to fill the GPU); `LongConfig.q16` stages a block's rounded queries through a bf16 copy so the
q k^T products read them from shared memory; `SplitConfig.min_tiles` gives a chain with few
ancestor tiles fewer split ranges. Piece offsets are declared multiples of `PIECE_ALIGN`
elements, so fp32 K/V tiles read through the tables load 16 bytes at a time.

Every tile holds tokens of one segment only and the config is fixed by the head sizes (the tier
by the segment's own length, the split ranges by its own chain), so a token's bits depend on its
own segment's data alone: never on its segment's slot, its packed
rows, or what else (or how much) the launch holds. `P` (piece slots) is a bucket shape and a
compile-time constant like in the decode kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels._triton import Backend, helper, interpreting, kernel, next_pow2, use_triton
from engine.kernels.cutlass_gemm import FMHA_HEAD_DIM, FMHA_TILE_ROWS
from engine.kernels.decode_attention import (
    PIECE_ALIGN,
    PREP_PARTS,
    AttentionHeads,
    PrepInputs,
    _bf16_operand,
    _check_alignment,
    _fold,
    _fold_where,
    _gated,
    _piece_offsets,
    _reduce_piece,
    attend_row_reference,
    check_rope,
    launch_prep,
    prep_rows_reference,
)
from engine.kernels.decode_rows import PIECE_FIELDS
from engine.kernels.forest_tables import (
    BLOCK_M,
    QB_LIVE,
    QB_LOCAL,
    QB_SEG,
    QBLOCK_FIELDS,
    ROW_FIELDS,
    ROW_LIVE,
    ROW_LOCAL,
    ROW_SEG,
    SEG_FIELDS,
    SEG_LENGTH,
    SEG_TOK_LO,
)

tl: Any = None  # bound at first launch (engine.kernels._triton)
libdevice: Any = None

NUM_WARPS = 4
_LOG2E = 1.4426950408889634  # the large-block kernel's exponentials are base 2
# Precisions of the attention dots (`_reduce_piece`): "ieee" fp32 on the FMA units (the decode
# kernel's), "tf32" / "bf16" on tensor cores. Each is row-local with a fixed config, so a token's
# bits still depend on its own segment alone; the choice is one setting per engine.
ATTENTION_DOTS = ("ieee", "tf32", "bf16")
# The settings under which long segments take the large-block tensor-core kernel.
LONG_DOTS = ("tf32", "bf16")
# Whether `forest_attention` splits long ancestors (`SplitConfig`, bf16 dots) when its caller
# does not say (`engine.run.body` passes no `split`). On since 2026-12-04 (H200, 27B heads,
# `ops/bench/bench_attention.py`, graph-timed): a 36-token question after a cached 8,156-token
# evidence 483 -> 114 us a layer, workload (c) 3,631 -> 3,273; (a) / (b), whose ~250 ancestor keys
# stay under min_keys, pay the plan and split launches only (+2 / +5 us a layer).
SPLIT_BY_DEFAULT = True
# Whether the large-block tiers (with their bf16 shadow) run on a side stream, beside the split and
# the 16-row kernel, on CUDA. Why: the two halves read the same K/V tables and write disjoint rows
# of `out` (the 16-row kernel skips the long segments' blocks, the tiers take only those), so
# nothing orders them but the stream; serial, workload (a)'s layer waits out its 220-token
# evidence's 96 large-block programs (~27 us) before its question's 72 16-row programs (~29 us)
# start, each far from filling 132 SMs. Branches of a captured graph run side by side; which
# kernel finishes first changes no bit (no shared partial, no atomic; on the H200, 2026-12-04
# session 16, eager and in a captured graph: the one-stream bits). Off until an H200 times it
# (`bench_engine.py --variants tc64inv,tc64inv-concurrenttiers`): the device was withdrawn
# before the engine run.
CONCURRENT_TIERS = False
# Whether `forest_attention` allocates its output uninitialized and zeroes only the rows the rows
# table marks dead (`_zero_dead_rows_kernel`: padding rows, which no query block covers), instead
# of zero-filling the whole output first. Why: every live row is written whole by the kernel that
# serves its query block (the 16-row kernel, a tier, or the split's first fold), so the fill is
# pure traffic: 201 MB a layer at 27B's 8,192 rows, 61 us on an H100, 15 layers of workload (c)
# (session 19's profile). The same output, bit for bit, padding zeros included. Off until a GPU
# times it (`bench_engine.py --variants tc64inv,tc64inv-attnzerodead`).
ZERO_DEAD_ROWS_ONLY = False
# Whether the body's attention layers under bf16 dots take their queries as bf16 from the prep
# (`forest_attention_prep(q_dtype=torch.bfloat16)`): every kernel here rounds a query to bf16 before
# its first product anyway, so the prep storing the rounded value gives the same bits, and at 8k
# tokens a 27B layer writes and reads 100 MB of queries less (201 MB fp32) and skips the q16
# staging copy (another 100 MB). On since session 30, with the FMHA tier below (which reads them in
# place): H100, 27B (c) 466.8-469.9 ms against 472.1-476.9 without both, four pairs, one process each
# (ops/bench/RESULTS.md, session 30).
QUERIES_BF16 = True
# Whether the last large-block tier (segments of at least TIER_LENGTH tokens; head_dim 256, bf16
# dots) attends its segments' own causal block in CUTLASS's Hopper FMHA kernel
# (`cutlass_gemm.Library.forest_fmha`, `cuda/forest_fmha_sm90.cuh`: a TMA producer warp group, two
# wgmma consumer groups, 128 query rows by 64-key steps) instead of its Triton tiles; the tier's
# Triton kernel then walks the ancestors as before and folds the kernel's (output, LSE) in as one
# more piece (`OWN_FMHA`), then the gate. Why: the Triton tier runs head 256 at ~300-330 TFLOP/s
# (255 registers, spills); the example kernel ran 590-655 on the same H100 (session 28), ~1 ms a
# 27B layer at 8k. Other rounding than the Triton tier (another tile and softmax order), the same
# invariance: a segment's tiles read its own rows only (the header says why). #27's accuracy check
# (4B, session 30): 36 of 36 decisive read-outs agree with the fp32 path, as without it, max |dp|
# the same 0.109. None (the default): on CUDA where the CUTLASS library has the unit (`make
# cutlass`; a GPU without it runs the Triton tier, as it runs the Triton GEMMs), off elsewhere (the
# interpreter keeps the Triton tier's arithmetic); True: always (CUDA without the unit raises, the
# interpreter runs `forest_fmha_reference`); False: never.
FMHA_LONG_TIER: bool | None = None
FMHA_TILE = FMHA_TILE_ROWS  # query rows of the FMHA kernel's tile: the unit of its work list
# Rows past the call's last that a segment's tail tile may read: Q and the K/V shadow carry them
# (K/V zeroed: a value the kernel multiplies by a probability of 0 must be finite).
FMHA_PAD = FMHA_TILE_ROWS
# `_zero_dead_rows_kernel`'s tile: rows a program checks, and columns it stores a step.
ZERO_ROWS = 16
ZERO_COLUMNS = 1024


@dataclass(frozen=True)
class LongConfig:
    """The large-block kernel's fixed config. A segment of at least `min_length` tokens is
    attended in blocks of `block_m` query rows (aligned to the segment start, like the 16-row
    blocks) over tiles of `block_l` keys (aligned to each piece's start); shorter segments keep
    the 16-row kernel. Both choices depend on the segment's own length and the head size only,
    so a token's bits still depend on its own segment alone."""

    block_m: int
    block_l: int
    num_warps: int
    min_length: int
    num_stages: int = 2
    # bf16 dots: the long segments' own K/V are rounded once into a transient bf16 shadow
    # (`_shadow_kernel`) that the kernel loads straight into shared memory; False rounds the fp32
    # tiles in registers as they are loaded (same bits; costs registers and spills at head_dim 256)
    bf16_kv: bool = True
    # keys per ancestor tile: ancestors stay fp32 where they lie (the prefix cache) and are
    # rounded in registers, so a smaller tile keeps that path from setting the register count;
    # 0: block_l
    ancestor_block_l: int = 0
    # bf16 dots: the block's queries, rounded to bf16 in registers, are stored to a transient
    # bf16 copy and loaded back before the key loop, so the compiler feeds the q k^T products
    # from shared memory instead of holding [BM, head_dim] bf16 operands in registers (64 of
    # them per thread at 128 rows on 8 warps: the difference between spilling and not). The same
    # rounded values reach the same products, so the bits are those of q16=False.
    q16: bool = False
    # segments of at least this many tokens belong to the next tier (`long_configs`); 0: no bound
    max_length: int = 0

    @property
    def ancestor_l(self) -> int:
        """Keys per ancestor tile."""
        return self.ancestor_block_l or self.block_l

    def __post_init__(self) -> None:
        if self.max_length and self.max_length <= self.min_length:
            raise ValueError(f"max_length must be 0 or > min_length: {self.max_length}, {self.min_length}")
        if self.block_m % BLOCK_M or self.block_m % self.block_l or self.block_l < 16:
            raise ValueError(
                f"block_m must be a multiple of {BLOCK_M} and of block_l >= 16: "
                f"{self.block_m}, {self.block_l}"
            )
        bla = self.ancestor_block_l
        if bla and (bla < 16 or bla & (bla - 1)):
            raise ValueError(f"ancestor_block_l must be 0 or a power of two >= 16: {self.ancestor_block_l}")
        if self.min_length < 1:
            raise ValueError(f"min_length must be >= 1, got {self.min_length}")


def long_config(head_dim: int, dots: str = "bf16") -> LongConfig:
    """The shipped large-block config for a head size and dot format. At head_dim 256 a
    [BM, 256] fp32 accumulator costs BM / 2 registers per thread over 8 warps. bf16: 128 query
    rows, 8 warps, 32-key tiles from the bf16 shadow, two stages, ancestors in 32-key tiles:
    the fastest of the H200 sweep (2026-12-01, ops/bench/RESULTS.md) at (b) and (c) - 3.27 ms a
    27B layer at 8k (252 TFLOP/s) against 5.40 for 64-row blocks over 64-key tiles and 7.76 for
    fp32 tiles rounded in registers - though it spills 208 B per thread on sm_90 (triton 3.6).
    tf32 keeps fp32 tiles of 32 keys (at 64, 320 KiB of shared memory,
    over the 227 KiB a block may have)."""
    if head_dim >= 256:
        if dots == "bf16":
            return LongConfig(
                block_m=128, block_l=32, num_warps=8, min_length=128, num_stages=2, ancestor_block_l=32
            )
        return LongConfig(block_m=64, block_l=32, num_warps=8, min_length=128)
    return LongConfig(block_m=64, block_l=32, num_warps=4, min_length=64)


# Forms of the large-block tiers (`long_configs`): "s10" is the single config measured in session
# 10 (`long_config`); "tiered" gives segments under TIER_LENGTH tokens 64-row blocks over 64-key
# tiles (twice the programs: workload (a)'s 220-token evidence fills 96 programs instead of 48)
# and longer ones 128-row blocks over 32-key tiles in three stages, ancestors in 16-key tiles and
# the queries fed from shared memory (`LONG_TIER`). Default since the H200 run of 2026-12-04
# (`ops/bench/bench_attention.py`, 27B heads, us a layer): (a) 74.4 -> 55.9 and (b) 98.8 -> 81.8
# for the short tier's config, the 8k evidence's large-block kernel 3,042 -> 2,116 for the long
# tier's (other rounding than s10: another tile size and ancestor fold order, the same invariance).
LONG_FORMS = ("s10", "tiered")
LONG_FORM = "tiered"
# Where the tiered form's short tier ends (tokens of the segment itself).
TIER_LENGTH = 1024
# The tiered form's long tier at head_dim >= 256 (bf16): fastest of the 2026-12-04 candidates at
# the 8k evidence (2.12 ms a 27B layer against 2.13 for 64-key tiles in two stages, 3.04 for the
# session-10 config; 160 KiB shared memory, 255 registers, 400 B spilled per thread on sm_90).
LONG_TIER = LongConfig(
    block_m=128, block_l=32, num_warps=8, min_length=TIER_LENGTH, num_stages=3, ancestor_block_l=16, q16=True
)


# The FMHA tier's Triton launch (ancestors, then the fold and the gate): no own tiles left to
# feed, so light blocks - 32 rows on 4 warps ([32, 128] fp32 halves, no spills) - instead of the
# long tier's 128-row, 255-register ones, whose 1,536 programs at 8k ran ~0.68 ms a 27B layer
# (H100, session 29) for what is mostly moving the output, the gate and the queries once.
# min_length / max_length are the tier's.
FMHA_FOLD = LongConfig(block_m=32, block_l=32, num_warps=4, min_length=1, ancestor_block_l=16)


def long_configs(head_dim: int, dots: str = "bf16", form: str | None = None) -> tuple[LongConfig, ...]:
    """The large-block tiers for a head size, dot format and form (None: `LONG_FORM`), by
    segment length ascending: tier i takes segments of min_length <= length < max_length (the
    next tier's min_length). Which tier attends a segment depends on its own length alone.
    At head_dim 256 (bf16) the short tier is session 5b's 64 rows over 64-key tiles on 8 warps
    (the two warp groups split the products' columns; 254 registers, no spills in the sm_90
    build) and the long one `LONG_TIER` (q16 and three stages: it does not lower the register
    count, but it was the fastest at 8k); other head sizes keep `long_config` for the long tier."""
    form = LONG_FORM if form is None else form
    if form not in LONG_FORMS:
        raise ValueError(f"form must be one of {LONG_FORMS}, got {form!r}")
    big = long_config(head_dim, dots)
    if form == "s10" or dots != "bf16":
        return (big,)
    if head_dim >= 256:
        short = LongConfig(
            block_m=64, block_l=64, num_warps=8, min_length=big.min_length, num_stages=2,
            ancestor_block_l=32, max_length=TIER_LENGTH,
        )  # fmt: skip
    else:
        short = LongConfig(
            block_m=32, block_l=32, num_warps=4, min_length=big.min_length, max_length=TIER_LENGTH
        )
    if head_dim >= 256:
        return (short, LongConfig(**{**LONG_TIER.__dict__, "min_length": TIER_LENGTH}))
    return (short, dataclasses.replace(big, min_length=TIER_LENGTH))


def _check_tiers(tiers: tuple[LongConfig, ...]) -> None:
    """Tiers must cover [tiers[0].min_length, inf) without a gap or an overlap."""
    for a, b in zip(tiers, tiers[1:], strict=False):
        if a.max_length != b.min_length:
            raise ValueError(
                f"tier bounds must meet: max_length {a.max_length}, next min_length {b.min_length}"
            )
    if not tiers or tiers[-1].max_length:
        raise ValueError("the last tier must have max_length 0 (no upper bound)")


@dataclass(frozen=True)
class SplitConfig:
    """The ancestor split's fixed config (bf16 dots). A query block of a short segment (one the
    16-row kernel attends: under `min_length` of the large-block config) whose ancestors hold at
    least `min_keys` keys has its ancestor keys cut into `splits` contiguous ranges of whole
    tiles of `block_l` keys (tiles aligned to each piece start, numbered piece after piece; range
    s holds tiles [s NT / S, (s + 1) NT / S) of the chain's NT), each reduced by its own program
    over the G query heads of one KV head at once (every K/V tile loaded once for all G heads),
    and the partials are folded in split order. Everything here is fixed or a function of the
    segment's own chain, so a token's bits still depend on its own segment alone.

    `capacity`: query blocks per call whose splits run in parallel (their partials need a
    workspace, [capacity, nkv, splits, G * 16, head_dim] fp32); the blocks past it (in query-block
    table order) run all their splits in one program, folding each partial as it is made. Both
    ways run the same instructions for a partial and fold in the same order, so which way a block
    takes - decided by the rest of the batch - does not change its bits (tested alone vs packed
    with a small capacity)."""

    splits: int
    min_keys: int
    capacity: int
    block_l: int = 32
    num_warps: int = 8
    num_stages: int = 1
    # a chain of NT ancestor tiles uses U = min(splits, max(1, NT // min_tiles)) of its ranges
    # (range s < U: tiles [s NT / U, (s + 1) NT / U)), so each holds >= min_tiles tiles: short
    # ancestors (~250 keys in workloads (a) and (b)) get a few ranges, not `splits` near-empty ones
    # whose queries and partials cost more than their keys. U depends on the chain alone. With 1,
    # U = splits (or NT below that: one tile a range, the same partials as empty ranges between)
    min_tiles: int = 1

    def __post_init__(self) -> None:
        if self.min_tiles < 1:
            raise ValueError(f"min_tiles must be >= 1, got {self.min_tiles}")
        if self.splits < 1 or self.min_keys < 1 or self.capacity < 0:
            raise ValueError(
                f"splits and min_keys must be >= 1 and capacity >= 0: {self.splits}, {self.min_keys}, "
                f"{self.capacity}"
            )
        if self.block_l < 16 or self.block_l & (self.block_l - 1):
            raise ValueError(f"block_l must be a power of two >= 16: {self.block_l}")


def split_config(head_dim: int, dots: str = "bf16") -> SplitConfig | None:
    """The shipped ancestor split for a head size and dot format (bf16 only; None: no split).
    At 27B one 36-token question after ~8,200 ancestor keys is 3 query blocks x 4 KV heads = 12
    (block, KV head) pairs: 11 splits make 132 programs, one per H200 SM, each reducing ~745 keys
    for 96 query rows (6 heads x 16 rows in one 128-row tile). The 16-row kernel walked all the
    keys in 72 programs of 16 rows (0.87 ms a layer). Tiles of 32 keys: the split kernel 84 us a
    layer at (c) against 111 for 16-key tiles (H200, 2026-12-04). Short ancestors (< 1,024 keys: the system
    prompt, workload (b)'s 256-token evidence) keep the 16-row kernel's walk. Capacity 16 (5
    such questions in one call) keeps the workspace at 69 MB; it never changes a bit."""
    if dots != "bf16":
        return None
    if head_dim >= 256:
        return SplitConfig(splits=11, min_keys=1024, capacity=16, block_l=32, num_warps=8, num_stages=2)
    return SplitConfig(splits=8, min_keys=512, capacity=16, block_l=32, num_warps=4)


def attention_warps(head_dim: int) -> int:
    """Warps of the attention kernel. At head_dim 256 (q, running output and per-piece output
    [16, 256] fp32, K and V [32, 256]) 4 warps leave sm_90 spilling 6 KB per thread to the stack;
    8 warps fit in 190 registers (`ops/bench/kernel_resources.py`)."""
    return 8 if head_dim >= 256 else NUM_WARPS


def _block_l(head_dim: int) -> int:
    """Keys per block: a [BLOCK_L, head_dim] fp32 tile of K and of V per step."""
    return 32 if head_dim >= 256 else 64


def _attention_kernel(
    q_ptr, qg_ptr, base_ptr, segs_ptr, pieces_ptr, qblocks_ptr, out_ptr, rank_ptr, ws_ml_ptr, ws_acc_ptr,
    ml_ptr, stride_qg, scale, capacity,
    NH: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, P: tl.constexpr, BM: tl.constexpr,
    BL: tl.constexpr, DOTS: tl.constexpr, LONG_MIN: tl.constexpr, SPLIT: tl.constexpr, S: tl.constexpr,
    SBL: tl.constexpr, MIN_TILES: tl.constexpr, ALIGN: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    qb = tl.program_id(0)
    h = tl.program_id(1)
    # query block record: segment slot, first local index, live
    if tl.load(qblocks_ptr + qb * 3 + 2) == 0:
        return
    seg = tl.load(qblocks_ptr + qb * 3)
    local0 = tl.load(qblocks_ptr + qb * 3 + 1)
    tok_lo = tl.load(segs_ptr + seg * 8)  # segment record: tok_lo, length, ...
    length = tl.load(segs_ptr + seg * 8 + 1)
    if LONG_MIN > 0:  # noqa: SIM102 - a constexpr test, then a runtime one (no mixed `and`)
        if length >= LONG_MIN:  # the large-block kernel attends this segment
            return
    local = local0 + tl.arange(0, BM)
    valid = local < length
    rows = tok_lo + local
    offs_d = tl.arange(0, HD)
    q = tl.load(q_ptr + (rows[:, None] * NH + h) * HD + offs_d[None, :], mask=valid[:, None], other=0.0)
    q = q.to(tl.float32)  # bf16 queries (`QUERIES_BF16`) are already rounded: exact either way
    kvh = h // G

    m = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, HD), dtype=tl.float32)
    if SPLIT:  # the ancestors of a split block are already reduced (`_split_kernel`): start from them
        rank = tl.load(rank_ptr + qb)
        if rank >= 0:
            if rank < capacity:  # its partials, folded in split order (an empty range is skipped)
                tiles = rank * 0  # the chain's ancestor tiles of SBL keys: it used min(S, tiles // MIN_TILES)
                for p in tl.static_range(P - 1):
                    tiles += (tl.load(pieces_ptr + (seg * P + p) * 4 + 2) + SBL - 1) // SBL
                for s in range(0, tl.minimum(tl.maximum(tiles // MIN_TILES, 1), S)):
                    at = ((rank * (NH // G) + kvh) * S + s) * (G * BM) + (h - kvh * G) * BM + tl.arange(0, BM)
                    sum_p = tl.load(ws_ml_ptr + at * 2 + 1, mask=valid, other=0.0)
                    has = sum_p > 0.0
                    m_p = tl.load(ws_ml_ptr + at * 2, mask=has, other=float("-inf"))
                    acc_p = tl.load(
                        ws_acc_ptr + at[:, None] * HD + offs_d[None, :], mask=has[:, None], other=0.0
                    )
                    m, total, acc = _fold_where(has, m, total, acc, m_p, sum_p, acc_p)
            else:  # folded by the split kernel itself, left in (ml, out)
                at = rows * NH + h
                m = tl.load(ml_ptr + at * 2, mask=valid, other=float("-inf"))
                total = tl.load(ml_ptr + at * 2 + 1, mask=valid, other=0.0)
                acc = tl.load(out_ptr + at[:, None] * HD + offs_d[None, :], mask=valid[:, None], other=0.0)
    for p in tl.static_range(P):
        rec = pieces_ptr + (seg * P + p) * 4  # piece record: k_off, v_off, length, rows_per_head
        k_off, v_off = _piece_offsets(rec, ALIGN)
        k_base = base_ptr + k_off
        v_base = base_ptr + v_off
        n = tl.load(rec + 2)
        head_rows = tl.load(rec + 3)
        if p == P - 1:
            n = tl.minimum(length, local0 + BM)  # the own block: keys up to the block's last token
        elif SPLIT:
            n = tl.where(rank >= 0, 0, n)  # a split block's ancestors: done above
        k_base += kvh * head_rows * HD
        v_base += kvh * head_rows * HD
        # the own block causally (key l' <= the row's local index); ancestors whole
        last = local if p == P - 1 else tl.full((BM,), 0, tl.int64) + n - 1
        m_p, sum_p, acc_p = _reduce_piece(q, k_base, v_base, n, last, scale, BM, HD, BL, DOTS, ON_GPU)
        if n > 0:  # fold the piece into the running result (an empty piece is skipped)
            # m_p is finite: every row sees the piece's first key
            m, total, acc = _fold(m, total, acc, m_p, sum_p, acc_p)

    gate = tl.load(
        qg_ptr + rows[:, None] * stride_qg + h * 2 * HD + HD + offs_d[None, :], mask=valid[:, None], other=0.0
    )
    o = _gated(acc, total, gate)
    tl.store(out_ptr + (rows[:, None] * NH + h) * HD + offs_d[None, :], o, mask=valid[:, None])


def _operand(x, DOTS: tl.constexpr, ON_GPU: tl.constexpr):
    """x as a tensor-core dot operand: bf16 (rounded to nearest even) or fp32 for tf32."""
    return _bf16_operand(x, ON_GPU) if DOTS == "bf16" else x


def _long_tile(
    q_lo, q_hi, k_base, v_base, start, n, local, m, total, acc_lo, acc_hi, qk_scale,
    HD: tl.constexpr, BL: tl.constexpr, DOTS: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    KV16: tl.constexpr, ON_GPU: tl.constexpr, KEY_ROW: tl.constexpr,
):  # fmt: skip
    """One tile of BL keys from `start` folded into the running (max, sum, output) of the block's
    rows, in base-2 exponentials (qk_scale includes log2 e). The head dimension is handled in two
    halves (scores = q_lo k_lo^T + q_hi k_hi^T, output halves apart) so that only half of a fp32
    K or V tile is live in registers at a time. MASKED: keys past n (and, CAUSAL, past each
    row's own index) score -inf; an unmasked tile lies wholly inside every row's view. A row's
    first tile always holds a key it sees (every row sees key 0 of every piece), so its max is
    finite from then on and a fully masked later tile leaves it bitwise unchanged. KV16: k_base
    and v_base point into the bf16 shadow (`_shadow_kernel`: the same rounding, done once per
    pass), so the tiles go to the tensor cores as loaded, with no conversion in registers. KEY_ROW:
    elements from one key to the next (HD in a piece's [rows, HD] block of one KV head; NKV * HD
    in the shadow's [rows, NKV, HD])."""
    HH: tl.constexpr = HD // 2
    offs_d = tl.arange(0, HH)
    offs_l = start + tl.arange(0, BL)
    at = offs_l[:, None] * KEY_ROW + offs_d[None, :]
    lmask = offs_l < n
    if MASKED:
        k_lo = tl.load(k_base + at, mask=lmask[:, None], other=0.0)
        k_hi = tl.load(k_base + HH + at, mask=lmask[:, None], other=0.0)
    else:
        k_lo = tl.load(k_base + at)
        k_hi = tl.load(k_base + HH + at)
    if KV16:
        s = tl.dot(q_lo, tl.trans(k_lo))
        s = tl.dot(q_hi, tl.trans(k_hi), acc=s)
    elif DOTS == "bf16":
        s = tl.dot(q_lo, tl.trans(_operand(k_lo, DOTS, ON_GPU)))
        s = tl.dot(q_hi, tl.trans(_operand(k_hi, DOTS, ON_GPU)), acc=s)
    else:
        s = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOTS)
        s = tl.dot(q_hi, tl.trans(k_hi), acc=s, input_precision=DOTS)
    s = s * qk_scale
    if MASKED:
        seen = lmask[None, :]
        if CAUSAL:
            seen = seen & (offs_l[None, :] <= local[:, None])
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    e = tl.exp2(s - m_new[:, None])
    total = total * alpha + tl.sum(e, axis=1)
    ed = _operand(e, DOTS, ON_GPU)
    v_lo = tl.load(v_base + at, mask=lmask[:, None], other=0.0) if MASKED else tl.load(v_base + at)
    if KV16:
        acc_lo = tl.dot(ed, v_lo, acc=acc_lo * alpha[:, None])
    elif DOTS == "bf16":
        acc_lo = tl.dot(ed, _operand(v_lo, DOTS, ON_GPU), acc=acc_lo * alpha[:, None])
    else:
        acc_lo = tl.dot(ed, v_lo, acc=acc_lo * alpha[:, None], input_precision=DOTS)
    v_hi = tl.load(v_base + HH + at, mask=lmask[:, None], other=0.0) if MASKED else tl.load(v_base + HH + at)
    if KV16:
        acc_hi = tl.dot(ed, v_hi, acc=acc_hi * alpha[:, None])
    elif DOTS == "bf16":
        acc_hi = tl.dot(ed, _operand(v_hi, DOTS, ON_GPU), acc=acc_hi * alpha[:, None])
    else:
        acc_hi = tl.dot(ed, v_hi, acc=acc_hi * alpha[:, None], input_precision=DOTS)
    return m_new, total, acc_lo, acc_hi


def _long_attention_kernel(
    q_ptr, qg_ptr, base_ptr, segs_ptr, pieces_ptr, qblocks_ptr, out_ptr, k16_ptr, v16_ptr, q16_ptr, lse_ptr,
    stride_qg, qk_scale,
    NH: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, P: tl.constexpr, BM: tl.constexpr,
    BL: tl.constexpr, BLA: tl.constexpr, DOTS: tl.constexpr, LONG_MIN: tl.constexpr, LONG_MAX: tl.constexpr,
    KV16: tl.constexpr, Q16: tl.constexpr, OWN_FMHA: tl.constexpr, ALIGN: tl.constexpr, OWN_ROW: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    # OWN_ROW: elements between the own block's keys (NKV * HD in the KV16 shadow, else HD).
    # heads fastest: the G heads that read one KV head run side by side and share its tiles in L2;
    # query blocks last first, so the longest causal walks start first
    h = tl.program_id(0)
    qb = tl.num_programs(1) - 1 - tl.program_id(1)
    if tl.load(qblocks_ptr + qb * 3 + 2) == 0:
        return
    seg = tl.load(qblocks_ptr + qb * 3)
    local0 = tl.load(qblocks_ptr + qb * 3 + 1)
    tok_lo = tl.load(segs_ptr + seg * 8)
    length = tl.load(segs_ptr + seg * 8 + 1)
    # a long segment's 16-row records: the one at each multiple of BM runs the large block
    if length < LONG_MIN:
        return
    if LONG_MAX > 0:  # noqa: SIM102 - a constexpr test, then a runtime one
        if length >= LONG_MAX:  # the next tier's
            return
    if local0 % BM != 0:
        return
    HH: tl.constexpr = HD // 2
    local = local0 + tl.arange(0, BM)
    valid = local < length
    rows = tok_lo + local
    offs_d = tl.arange(0, HH)
    q_at = (rows[:, None] * NH + h) * HD + offs_d[None, :]
    q_lo = _operand(tl.load(q_ptr + q_at, mask=valid[:, None], other=0.0).to(tl.float32), DOTS, ON_GPU)
    q_hi = _operand(tl.load(q_ptr + HH + q_at, mask=valid[:, None], other=0.0).to(tl.float32), DOTS, ON_GPU)
    if Q16:  # through the block's own rows of a bf16 copy: loaded, the operands stay in shared memory
        tl.store(q16_ptr + q_at, q_lo, mask=valid[:, None])
        tl.store(q16_ptr + HH + q_at, q_hi, mask=valid[:, None])
        tl.debug_barrier()  # every thread's stores are seen by the loads below (one block)
        q_lo = tl.load(q16_ptr + q_at, mask=valid[:, None], other=0.0)
        q_hi = tl.load(q16_ptr + HH + q_at, mask=valid[:, None], other=0.0)
    kvh = h // G

    m = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.zeros((BM,), dtype=tl.float32)
    acc_lo = tl.zeros((BM, HH), dtype=tl.float32)
    acc_hi = tl.zeros((BM, HH), dtype=tl.float32)
    # chain order: the ancestors oldest first (fp32 K/V where they lie, in tiles of BLA keys),
    # then the own block (in tiles of BL keys, from the bf16 shadow under KV16)
    for p in tl.static_range(P - 1):
        rec = pieces_ptr + (seg * P + p) * 4  # piece record: k_off, v_off, length, rows_per_head
        head_rows = tl.load(rec + 3)
        k_off, v_off = _piece_offsets(rec, ALIGN)
        k_base = base_ptr + k_off + kvh * head_rows * HD
        v_base = base_ptr + v_off + kvh * head_rows * HD
        n = tl.load(rec + 2)
        full = (n // BLA) * BLA
        for start in range(0, full, BLA):
            m, total, acc_lo, acc_hi = _long_tile(
                q_lo, q_hi, k_base, v_base, start, n, local, m, total, acc_lo, acc_hi, qk_scale,
                HD, BLA, DOTS, False, False, False, ON_GPU, HD,
            )  # fmt: skip
        for start in range(full, n, BLA):
            m, total, acc_lo, acc_hi = _long_tile(
                q_lo, q_hi, k_base, v_base, start, n, local, m, total, acc_lo, acc_hi, qk_scale,
                HD, BLA, DOTS, True, False, False, ON_GPU, HD,
            )  # fmt: skip
    o_at = (rows[:, None] * NH + h) * HD + offs_d[None, :]
    if OWN_FMHA:  # the own block is done (`forest_fmha`): its normalised output in out, its LSE
        # (natural, of the scaled scores) in lse: one more piece of weight exp(lse) and sum 1
        m_p = tl.load(lse_ptr + rows * NH + h, mask=valid, other=0.0) * 1.4426950408889634  # log2(e)
        m_new = tl.maximum(m, m_p)
        alpha = tl.exp2(m - m_new)  # 0 without ancestors (m = -inf)
        beta = tl.exp2(m_p - m_new)
        total = total * alpha + beta
        o_lo = tl.load(out_ptr + o_at, mask=valid[:, None], other=0.0)
        acc_lo = acc_lo * alpha[:, None] + o_lo * beta[:, None]
        o_hi = tl.load(out_ptr + HH + o_at, mask=valid[:, None], other=0.0)
        acc_hi = acc_hi * alpha[:, None] + o_hi * beta[:, None]
    else:
        n = tl.minimum(length, local0 + BM)  # the own block: keys up to the block's last token
        full = local0  # keys every row of the block sees (a multiple of BL: BL divides BM)
        if KV16:  # the own keys' bf16 shadow: [t_rows, NKV, HD], row = packed token
            k_base = k16_ptr + (tok_lo * (NH // G) + kvh) * HD
            v_base = v16_ptr + (tok_lo * (NH // G) + kvh) * HD
        else:
            rec = pieces_ptr + (seg * P + P - 1) * 4
            head_rows = tl.load(rec + 3)
            k_off, v_off = _piece_offsets(rec, ALIGN)
            k_base = base_ptr + k_off + kvh * head_rows * HD
            v_base = base_ptr + v_off + kvh * head_rows * HD
        for start in range(0, full, BL):
            m, total, acc_lo, acc_hi = _long_tile(
                q_lo, q_hi, k_base, v_base, start, n, local, m, total, acc_lo, acc_hi, qk_scale,
                HD, BL, DOTS, False, False, KV16, ON_GPU, OWN_ROW,
            )  # fmt: skip
        for start in range(full, n, BL):
            m, total, acc_lo, acc_hi = _long_tile(
                q_lo, q_hi, k_base, v_base, start, n, local, m, total, acc_lo, acc_hi, qk_scale,
                HD, BL, DOTS, True, True, KV16, ON_GPU, OWN_ROW,
            )  # fmt: skip

    inv = 1.0 / tl.where(total > 0, total, 1.0)
    g_at = rows[:, None] * stride_qg + h * 2 * HD + HD + offs_d[None, :]
    gate = tl.load(qg_ptr + g_at, mask=valid[:, None], other=0.0)
    o = (acc_lo * inv[:, None]) * (1.0 / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + o_at, o, mask=valid[:, None])
    gate = tl.load(qg_ptr + HH + g_at, mask=valid[:, None], other=0.0)
    o = (acc_hi * inv[:, None]) * (1.0 / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + HH + o_at, o, mask=valid[:, None])


def _shadow_kernel(
    base_ptr, rows_ptr, segs_ptr, pieces_ptr, k16_ptr, v16_ptr, n_rows,
    HD: tl.constexpr, P: tl.constexpr, LONG_MIN: tl.constexpr, ZERO: tl.constexpr, ALIGN: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program (packed row, KV head): a live row of a long segment copies its key and value from
    its segment's own fp32 block into the bf16 shadow [t_rows, NKV, HD] at its packed row, rounded
    to nearest even exactly as `_bf16_operand` rounds them in registers (so the large-block kernel
    gives the same bits either way). Loaded as bf16, the tiles go to shared memory (cp.async
    when pipelined) and from there to the tensor cores, with no conversion in registers. Under
    the interpreter the rounded values stay fp32. ZERO (the FMHA tier, whose tail tiles read past
    a segment's end): every other row, the padding rows past n_rows included, is zeroed instead
    of left as it was, so all the kernel reads is finite."""
    row = tl.program_id(0)
    kv = tl.program_id(1)
    live = tl.load(rows_ptr + row * 4 + 2, mask=row < n_rows, other=0)
    seg = tl.load(rows_ptr + row * 4, mask=live != 0, other=0)
    # short segments keep the 16-row kernel
    long = (live != 0) & (tl.load(segs_ptr + seg * 8 + 1, mask=live != 0, other=0) >= LONG_MIN)
    to = (row * tl.num_programs(1) + kv) * HD + tl.arange(0, HD)
    if long:
        local = tl.load(rows_ptr + row * 4 + 1)
        own = pieces_ptr + (seg * P + (P - 1)) * 4  # piece record: k_off, v_off, length, rows_per_head
        at = (kv * tl.load(own + 3) + local) * HD + tl.arange(0, HD)
        k_off, v_off = _piece_offsets(own, ALIGN)
        tl.store(k16_ptr + to, _bf16_operand(tl.load(base_ptr + k_off + at), ON_GPU))
        tl.store(v16_ptr + to, _bf16_operand(tl.load(base_ptr + v_off + at), ON_GPU))
    else:
        if ZERO:
            zeros = tl.zeros((HD,), dtype=k16_ptr.dtype.element_ty)
            tl.store(k16_ptr + to, zeros)
            tl.store(v16_ptr + to, zeros)


def _fmha_plan_kernel(
    segs_ptr, tiles_ptr, count_ptr, n_segs, capacity,
    LONG_MIN: tl.constexpr, TILE: tl.constexpr, CHUNK: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """One program: the FMHA tier's work list. For every live segment of at least LONG_MIN tokens,
    in slot order, its TILE-row query tiles last first (the longest causal walks start first):
    tiles[i] = (segment-local tile, first packed row, length, 0), and count. A tile's place in the
    list decides only which CTA runs it, never its bits."""
    done = n_segs * 0
    for s in range(0, n_segs):
        length = tl.load(segs_ptr + s * 8 + 1)
        live = tl.load(segs_ptr + s * 8 + 7)
        row = tl.load(segs_ptr + s * 8)
        n = tl.where((live != 0) & (length >= LONG_MIN), (length + TILE - 1) // TILE, 0).to(tl.int32)
        for start in range(0, n, CHUNK):
            i = start + tl.arange(0, CHUNK)
            at = done + i
            ok = (i < n) & (at < capacity)
            entry = tiles_ptr + at * 4
            tl.store(entry, (n - 1 - i).to(tl.int32), mask=ok)
            tl.store(entry + 1, (row + i * 0).to(tl.int32), mask=ok)
            tl.store(entry + 2, (length + i * 0).to(tl.int32), mask=ok)
            tl.store(entry + 3, (i * 0).to(tl.int32), mask=ok)
        done += n
    tl.store(count_ptr, tl.minimum(done, capacity).to(tl.int32))


def _split_plan_kernel(
    segs_ptr, pieces_ptr, qblocks_ptr, rank_ptr, list_ptr, count_ptr, n_qblocks,
    P: tl.constexpr, LONG_MIN: tl.constexpr, MIN_KEYS: tl.constexpr, CHUNK: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """One program: the query blocks whose ancestors are split (live, of a segment the 16-row
    kernel attends, with at least MIN_KEYS ancestor keys), numbered in table order: rank[qb]
    (-1: not split), list[rank] = qb, count. A block's rank only decides where its partials
    are kept and whether its splits run in parallel (`SplitConfig.capacity`), never its bits."""
    done = n_qblocks * 0
    for start in range(0, n_qblocks, CHUNK):
        qb = start + tl.arange(0, CHUNK)
        inside = qb < n_qblocks
        live = tl.load(qblocks_ptr + qb * 3 + 2, mask=inside, other=0)
        seg = tl.load(qblocks_ptr + qb * 3, mask=inside, other=0)
        keys = tl.zeros((CHUNK,), dtype=tl.int64)
        for p in tl.static_range(P - 1):
            keys += tl.load(pieces_ptr + (seg * P + p) * 4 + 2, mask=inside, other=0)
        split = inside & (live != 0) & (keys >= MIN_KEYS)
        if LONG_MIN > 0:  # the large-block kernel's segments are not the 16-row kernel's
            split = split & (tl.load(segs_ptr + seg * 8 + 1, mask=inside, other=0) < LONG_MIN)
        rank = done + tl.cumsum(split.to(tl.int32), axis=0) - 1
        tl.store(rank_ptr + qb, tl.where(split, rank, -1), mask=inside)
        tl.store(list_ptr + rank, qb.to(tl.int32), mask=split)
        done += tl.sum(split.to(tl.int32), axis=0)
    tl.store(count_ptr, done)


def _split_kernel(
    q_ptr, base_ptr, segs_ptr, pieces_ptr, qblocks_ptr, list_ptr, count_ptr, ws_ml_ptr, ws_acc_ptr,
    ml_ptr, out_ptr, n_prog, capacity, qk_scale,
    NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
    BM: tl.constexpr, P: tl.constexpr, S: tl.constexpr, BL: tl.constexpr, MIN_TILES: tl.constexpr,
    ALIGN: tl.constexpr, DOTS: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Persistent programs over the split blocks' work (`_split_plan_kernel` numbered them):
    unit (rank, KV head, s) for the first `capacity` blocks, which reduces split s and stores its
    partial in the workspace; unit (rank, KV head) for the others (taken first: S times
    longer), which reduces splits 0 .. S - 1 one after another, folding each into the block's
    (max, sum, output) kept in (ml, out). Program i takes units i, i + n_prog, ...

    A unit holds the block's BM rows for all G query heads of its KV head as one tile of GP * BM
    rows (row g * BM + r: head kvh * G + g, the block's row r; heads past G and rows past the
    segment are zero queries, never stored), so each K/V tile is loaded once for the G heads.
    A range's tiles use `_long_tile` (one online softmax, base-2 exponentials); its max is then
    taken to natural units (x ln 2) for the folds, which are `_fold_where`'s, as in the 16-row
    kernel. Both kinds of unit run one loop for the partial (s from s_lo to s_hi), so a block
    past the capacity gets the bits it would get within it."""
    HH: tl.constexpr = HD // 2
    R: tl.constexpr = GP * BM
    count = tl.load(count_ptr)
    n_long = tl.maximum(count - capacity, 0) * NKV
    n_units = n_long + tl.minimum(count, capacity) * NKV * S
    offs_j = tl.arange(0, R)
    g = offs_j // BM
    offs_r = offs_j % BM
    offs_d = tl.arange(0, HH)
    for u in range(tl.program_id(0), n_units, n_prog):
        folding = u < n_long
        v = u - n_long
        rank = tl.where(folding, capacity + u // NKV, v // (NKV * S))
        kvh = tl.where(folding, u % NKV, (v // S) % NKV)
        s_lo = tl.where(folding, 0, v % S)
        s_hi = tl.where(folding, S, v % S + 1)
        qb = tl.load(list_ptr + rank)
        seg = tl.load(qblocks_ptr + qb * 3)
        local0 = tl.load(qblocks_ptr + qb * 3 + 1)
        tok_lo = tl.load(segs_ptr + seg * 8)
        length = tl.load(segs_ptr + seg * 8 + 1)
        local = local0 + offs_r
        valid = (g < G) & (local < length)
        heads = kvh * G + g
        tiles = rank * 0  # the chain's ancestor tiles (int64)
        for p in tl.static_range(P - 1):
            tiles += (tl.load(pieces_ptr + (seg * P + p) * 4 + 2) + BL - 1) // BL
        used = tl.minimum(tl.maximum(tiles // MIN_TILES, 1), S)  # ranges this chain uses
        s_hi = tl.minimum(s_hi, used)  # a unit past them has nothing to do (none of it is read)
        if s_lo < s_hi:  # an idle unit loads nothing
            q_at = ((tok_lo + local)[:, None] * NH + heads[:, None]) * HD + offs_d[None, :]
            q_lo = _operand(
                tl.load(q_ptr + q_at, mask=valid[:, None], other=0.0).to(tl.float32), DOTS, ON_GPU
            )
            q_hi = _operand(
                tl.load(q_ptr + HH + q_at, mask=valid[:, None], other=0.0).to(tl.float32), DOTS, ON_GPU
            )
            for s in range(s_lo, s_hi):
                lo = s * tiles // used
                hi = (s + 1) * tiles // used
                m = tl.full((R,), float("-inf"), tl.float32)
                total = tl.zeros((R,), dtype=tl.float32)
                acc_lo = tl.zeros((R, HH), dtype=tl.float32)
                acc_hi = tl.zeros((R, HH), dtype=tl.float32)
                first = tiles * 0  # tiles of the pieces before this one
                for p in tl.static_range(P - 1):
                    rec = pieces_ptr + (seg * P + p) * 4  # piece record: k_off, v_off, length, rows_per_head
                    head_rows = tl.load(rec + 3)
                    k_off, v_off = _piece_offsets(rec, ALIGN)
                    k_base = base_ptr + k_off + kvh * head_rows * HD
                    v_base = base_ptr + v_off + kvh * head_rows * HD
                    n = tl.load(rec + 2)
                    n_tiles = (n + BL - 1) // BL
                    a = tl.minimum(tl.maximum(lo - first, 0), n_tiles)
                    b = tl.minimum(tl.maximum(hi - first, 0), n_tiles)
                    full = n // BL  # tiles of BL keys; a piece's last one may be partial (masked)
                    for j in range(a, tl.minimum(b, full)):
                        m, total, acc_lo, acc_hi = _long_tile(
                            q_lo, q_hi, k_base, v_base, j * BL, n, local, m, total, acc_lo, acc_hi, qk_scale,
                            HD, BL, DOTS, False, False, False, ON_GPU, HD,
                        )  # fmt: skip
                    for j in range(tl.maximum(a, full), b):
                        m, total, acc_lo, acc_hi = _long_tile(
                            q_lo, q_hi, k_base, v_base, j * BL, n, local, m, total, acc_lo, acc_hi, qk_scale,
                            HD, BL, DOTS, True, False, False, ON_GPU, HD,
                        )  # fmt: skip
                    first += n_tiles
                m = m * 0.6931471805599453  # natural units: x ln 2 (an empty range keeps -inf, total 0)
                if folding:  # fold into the block's running result (none before split 0)
                    row_at = (tok_lo + local) * NH + heads
                    o_at = row_at[:, None] * HD + offs_d[None, :]
                    seen = valid & (s > 0)
                    m_run = tl.load(ml_ptr + row_at * 2, mask=seen, other=float("-inf"))
                    total_run = tl.load(ml_ptr + row_at * 2 + 1, mask=seen, other=0.0)
                    has = total > 0.0
                    m_new = tl.where(has, tl.maximum(m_run, m), m_run)
                    old_scale = tl.where(has, tl.exp(m_run - m_new), 1.0)
                    new_scale = tl.where(has, tl.exp(m - m_new), 0.0)
                    acc_run = tl.load(out_ptr + o_at, mask=seen[:, None], other=0.0)
                    tl.store(out_ptr + o_at, acc_run * old_scale[:, None] + acc_lo * new_scale[:, None],
                             mask=valid[:, None])  # fmt: skip
                    acc_run = tl.load(out_ptr + HH + o_at, mask=seen[:, None], other=0.0)
                    tl.store(out_ptr + HH + o_at, acc_run * old_scale[:, None] + acc_hi * new_scale[:, None],
                             mask=valid[:, None])  # fmt: skip
                    tl.store(ml_ptr + row_at * 2, m_new, mask=valid)
                    tl.store(ml_ptr + row_at * 2 + 1, total_run * old_scale + total * new_scale, mask=valid)
                    tl.debug_barrier()  # the next split's loads read what every thread stored here
                else:  # the partial of split s, for the 16-row kernel to fold
                    ws_at = ((rank * NKV + kvh) * S + s) * (G * BM) + offs_j
                    keep = valid & (total > 0.0)  # an empty range stores only its zero sum
                    tl.store(ws_ml_ptr + ws_at * 2, m, mask=keep)
                    tl.store(ws_ml_ptr + ws_at * 2 + 1, total, mask=valid)
                    w_at = ws_at[:, None] * HD + offs_d[None, :]
                    tl.store(ws_acc_ptr + w_at, acc_lo, mask=keep[:, None])
                    tl.store(ws_acc_ptr + HH + w_at, acc_hi, mask=keep[:, None])


def _zero_dead_rows_kernel(
    out_ptr, rows_ptr, T, W, stride_out, stride_rows,
    LIVE: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Program i: of rows BR i .. BR i + BR - 1, those the rows table marks dead (ROW_LIVE 0) get
    zeros in all W columns of out; live rows are not touched (their kernels write them). LIVE:
    the rows table's live field (ROW_LIVE)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    inside = r < T
    live = tl.load(rows_ptr + r.to(tl.int64) * stride_rows + LIVE, mask=inside, other=1)
    dead = inside & (live == 0)
    at = r.to(tl.int64)[:, None] * stride_out
    zeros = tl.zeros((BR, BW), dtype=tl.float32)
    for c0 in range(0, W, BW):
        cols = c0 + tl.arange(0, BW)
        tl.store(out_ptr + at + cols[None, :], zeros, mask=dead[:, None] & (cols[None, :] < W))


_operand = helper(_operand)  # type: ignore[assignment]
_long_tile = helper(_long_tile)  # type: ignore[assignment]
_attn = kernel(_attention_kernel)
_long_attn = kernel(_long_attention_kernel)
_shadow = kernel(_shadow_kernel)
_split_plan = kernel(_split_plan_kernel)
_fmha_plan = kernel(_fmha_plan_kernel)
_split = kernel(_split_kernel)
_zero_dead_rows = kernel(_zero_dead_rows_kernel)


def _output(t: int, width: int, device: torch.device) -> torch.Tensor:
    """forest_attention's output, uninitialized (ZERO_DEAD_ROWS_ONLY: its kernels write every row)."""
    return torch.empty(t, width, dtype=torch.float32, device=device)


def _check_table(name: str, t: torch.Tensor, shape: tuple[int | None, ...], like: torch.Tensor) -> None:
    """t must be a contiguous int64 tensor of `shape` (None: any size) on like's device."""
    want = "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"
    if (
        t.dtype != torch.int64
        or t.dim() != len(shape)
        or any(s is not None and s != n for s, n in zip(shape, t.shape, strict=True))
    ):
        raise ValueError(f"{name} must be int64 {want}, got {t.dtype} {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, the activations on {like.device}")


def _check_tables(
    rows: torch.Tensor,
    segs: torch.Tensor,
    pieces: torch.Tensor,
    qblocks: torch.Tensor | None,
    t: int,
    like: torch.Tensor,
) -> None:
    _check_table("rows", rows, (t, ROW_FIELDS), like)
    _check_table("segs", segs, (None, SEG_FIELDS), like)
    _check_table("pieces", pieces, (segs.shape[0], None, PIECE_FIELDS), like)
    if pieces.shape[1] < 1:
        raise ValueError("pieces needs at least one piece per segment (the own K/V block, last)")
    if qblocks is not None:
        _check_table("qblocks", qblocks, (None, QBLOCK_FIELDS), like)


def _check_qg(qg: torch.Tensor, t: int, nh: int, hd: int) -> None:
    if qg.dim() != 2 or qg.shape != (t, nh * 2 * hd) or qg.stride(1) != 1:
        raise ValueError(
            f"qg must be [{t}, {nh * 2 * hd}] with unit column stride, got {tuple(qg.shape)} {qg.stride()}"
        )


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the kernels need a power-of-two head_dim >= 16, got {head_dim}")


def forest_attention_prep(
    x: PrepInputs,
    base: torch.Tensor,
    rows: torch.Tensor,
    segs: torch.Tensor,
    pieces: torch.Tensor,
    heads: AttentionHeads,
    *,
    part: str = "all",
    q_dtype: torch.dtype = torch.float32,
    pad_rows: int = 0,
    backend: Backend = "triton",
) -> torch.Tensor:
    """Normed, rotated queries [T, nh, hd] (fp32, or rounded to bf16 for bf16 dots: `q_dtype`,
    `QUERIES_BF16`); stores each live row's key and value in its segment's own K/V block (the last
    piece of `pieces[seg]`) at the row's local index. `pad_rows`: the queries are the first T rows
    of a buffer with that many more (`FMHA_PAD` lets the FMHA tier read them in place).

    rows [T, 4], segs [S, 8] and one attention layer's pieces [S, P, 4] as in
    `engine.kernels.forest_tables`; `x` as in `PrepInputs`. `part` (`PREP_PARTS`): "queries"
    makes the queries and stores nothing (x.k and x.v are not read: any tensors), "keys" stores
    the keys and values and makes no query (x.qg is not read; returns [T, 0, hd]); either gives
    the bits "all" gives (`launch_prep`). The body's last layer runs "keys" over every row and
    "queries" over its read rows only (a rows table of those rows: their slot, local index, live).
    """
    if part not in PREP_PARTS:
        raise ValueError(f"part must be one of {PREP_PARTS}, got {part!r}")
    like = x.k if part == "keys" else x.qg
    t = like.shape[0]
    _check_tables(rows, segs, pieces, None, t, like)
    if part != "keys":
        _check_qg(x.qg, t, heads.num_heads, heads.head_dim)
    width = heads.num_kv_heads * heads.head_dim
    for name, kv in (("k", x.k), ("v", x.v)) if part != "queries" else ():
        if kv.dim() != 2 or kv.shape != (t, width) or kv.stride(1) != 1:
            raise ValueError(
                f"{name} must be [{t}, {width}] with unit column stride, got {tuple(kv.shape)} {kv.stride()}"
            )
    check_rope(x.rope, t)
    if base.dtype != torch.float32:
        raise ValueError(f"base must be fp32, got {base.dtype}")
    if not use_triton(backend, like):
        return forest_attention_prep_reference(x, base, rows, segs, pieces, heads, part).to(q_dtype)
    _check_head_dim(heads.head_dim)
    if part == "queries":  # placeholders for the never-read k / v pointers: the query rows
        x = x._replace(k=x.qg, v=x.qg)
    return launch_prep(
        x, base, rows, pieces, heads, packed=True, part=part, q_dtype=q_dtype, pad_rows=pad_rows
    )


def forest_attention(
    q: torch.Tensor,
    qg: torch.Tensor,
    base: torch.Tensor,
    rows: torch.Tensor,
    segs: torch.Tensor,
    pieces: torch.Tensor,
    qblocks: torch.Tensor,
    *,
    num_kv_heads: int,
    dots: str = "ieee",
    long: LongConfig | tuple[LongConfig, ...] | bool = True,
    split: SplitConfig | bool | None = None,
    fmha: bool | None = None,
    backend: Backend = "triton",
) -> torch.Tensor:
    """Gated attention output fp32 [T, nh * hd] of queries q [T, nh, hd] over their segments' pieces.

    Rows covered by a live query block (qblocks [Q, 3]) get the output; every other row is zero
    (`out` starts as zeros). The gate is the second half of each head's [q | gate] in qg
    [T, nh * 2 * hd]. rows [T, 4] is only validated: the blocks come from qblocks and segs.
    dots: one of ATTENTION_DOTS; the torch reference computes in fp32 whatever it is. Under
    LONG_DOTS, segments of at least `min_length` tokens take the large-block kernel: `long`
    True is the shipped tiers (`long_configs` of `LONG_FORM`), False keeps the 16-row kernel for
    every segment (the previous behaviour, for benchmarks), a LongConfig is that one config for
    every long segment and a tuple of them tiers by segment length (tests, sweeps).
    `split`: the ancestor split of the 16-row kernel's blocks after long ancestors (bf16 dots
    only, `SplitConfig`): True is the shipped config (`split_config`), False walks every
    block's ancestors in its own program (the previous behaviour), a SplitConfig is that config,
    None is `SPLIT_BY_DEFAULT`.
    `fmha`: the last tier's own blocks in CUTLASS's FMHA kernel (True, False, or None: where the
    library has it on CUDA; `FMHA_LONG_TIER` is the default); it applies where that tier is
    unbounded, bf16 with the K/V shadow, at head_dim FMHA_HEAD_DIM. True on CUDA needs the CUTLASS
    library's FMHA unit; under the interpreter `forest_fmha_reference` stands in for the kernel.
    """
    if dots not in ATTENTION_DOTS:
        raise ValueError(f"dots must be one of {ATTENTION_DOTS}, got {dots!r}")
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"q must be fp32 or bf16 [T, nh, hd], got {q.dtype} {tuple(q.shape)}")
    if q.dtype == torch.bfloat16 and dots != "bf16":
        raise ValueError(f"bf16 queries are for bf16 dots only (they round q to bf16), got dots={dots!r}")
    t, nh, hd = q.shape
    _check_tables(rows, segs, pieces, qblocks, t, q)
    _check_qg(qg, t, nh, hd)
    if num_kv_heads < 1 or nh % num_kv_heads:
        raise ValueError(f"num_heads {nh} is not a multiple of num_kv_heads {num_kv_heads}")
    if base.dtype != torch.float32:
        raise ValueError(f"base must be fp32, got {base.dtype}")
    if not use_triton(backend, q):
        return forest_attention_reference(q.float(), qg, base, rows, segs, pieces, qblocks, num_kv_heads)
    _check_head_dim(hd)
    _check_alignment(pieces)
    if qblocks.shape[0] == 0 or t == 0:
        return torch.zeros(t, nh * hd, dtype=torch.float32, device=q.device)
    if not ZERO_DEAD_ROWS_ONLY:
        out = torch.zeros(t, nh * hd, dtype=torch.float32, device=q.device)
    else:
        out = _output(t, nh * hd, q.device)
        _zero_dead_rows[(-(-t // ZERO_ROWS),)](
            out, rows, t, nh * hd, out.stride(0), rows.stride(0),
            LIVE=ROW_LIVE, BR=ZERO_ROWS, BW=ZERO_COLUMNS, num_warps=4,
        )  # fmt: skip
    q = q.contiguous()
    tiers: tuple[LongConfig, ...] = ()
    if dots in LONG_DOTS and long is not False:
        if long is True:
            tiers = long_configs(hd, dots)
        elif isinstance(long, LongConfig):
            tiers = (long,)
        else:
            tiers = tuple(long)
        _check_tiers(tiers)
    scfg: SplitConfig | None = None
    if split is None:
        split = SPLIT_BY_DEFAULT
    if dots == "bf16" and split is not False:
        scfg = split_config(hd, dots) if split is True else split
    long_min = tiers[0].min_length if tiers else 0
    group = nh // num_kv_heads
    common = dict(NH=nh, HD=hd, G=group, P=pieces.shape[1], DOTS=dots)
    tiers = tuple(c for c in tiers if c.min_length <= t)  # a tier no segment of T rows reaches: idle
    fmha_tier = _fmha_tier(tiers, hd, dots, fmha, q.device)
    # bf16 when compiled; the interpreter has no bf16 arithmetic, so there fp32 holding the
    # rounded values
    dt = torch.float32 if interpreting() else torch.bfloat16
    k16 = v16 = q16 = lse = base  # not read
    kv_rows = t + FMHA_PAD if fmha_tier is not None else t
    if tiers and dots == "bf16" and any(c.bf16_kv for c in tiers):
        # transient bf16 copies of the long segments' own K/V (storage stays fp32); for the FMHA
        # tier the shadow zeroes every other row (`_shadow_kernel`'s ZERO)
        k16 = torch.empty(kv_rows, num_kv_heads, hd, dtype=dt, device=q.device)
        v16 = torch.empty_like(k16)
    staged = q.dtype == torch.float32  # bf16 queries are loaded as the staged copy would be
    if tiers and dots == "bf16" and staged and any(c.q16 for c in tiers):
        q16 = torch.empty(t, nh, hd, dtype=dt, device=q.device)  # each block writes its own rows
    main = torch.cuda.current_stream(q.device) if q.is_cuda else None
    side = _tier_stream(q.device) if tiers and main is not None and CONCURRENT_TIERS else None
    if side is not None:  # the buffers above were made on `main`, and `main` waits for `side` below
        side.wait_stream(main)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        if tiers and k16 is not base:
            _shadow[(kv_rows, num_kv_heads)](
                base, rows, segs, pieces, k16, v16, t,
                HD=hd, P=pieces.shape[1], LONG_MIN=long_min, ZERO=fmha_tier is not None, ALIGN=PIECE_ALIGN,
                num_warps=1,
            )  # fmt: skip
        if fmha_tier is not None:  # its segments' own blocks first: (output, LSE) into out and lse
            lse = _fmha_own_blocks(q, k16, v16, out, segs, fmha_tier.min_length, num_kv_heads)
        for tier in tiers:
            # the FMHA tier's launch only walks the ancestors and folds: `FMHA_FOLD`'s lighter blocks
            own = tier is fmha_tier
            cfg = (
                dataclasses.replace(FMHA_FOLD, min_length=tier.min_length, max_length=tier.max_length)
                if own
                else tier
            )
            kv16 = dots == "bf16" and cfg.bf16_kv
            _long_attn[(nh, qblocks.shape[0])](
                q, qg, base, segs, pieces, qblocks, out, k16 if kv16 else base, v16 if kv16 else base,
                q16 if q16 is not base and cfg.q16 else base, lse, qg.stride(0), hd**-0.5 * _LOG2E,
                BM=cfg.block_m, BL=cfg.block_l, BLA=cfg.ancestor_l, LONG_MIN=cfg.min_length,
                LONG_MAX=cfg.max_length, KV16=kv16, Q16=q16 is not base and cfg.q16, OWN_FMHA=own,
                ALIGN=PIECE_ALIGN, OWN_ROW=num_kv_heads * hd if kv16 else hd,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False, **common,
            )  # fmt: skip
    rank = ws_ml = ws_acc = ml = out  # not read without a split
    if scfg is not None:
        rank, ws_ml, ws_acc, ml = _launch_split(
            q, base, segs, pieces, qblocks, out, scfg, num_kv_heads=num_kv_heads, long_min=long_min, dots=dots
        )
    _attn[(qblocks.shape[0], nh)](
        q, qg, base, segs, pieces, qblocks, out, rank, ws_ml, ws_acc, ml, qg.stride(0), hd**-0.5,
        scfg.capacity if scfg else 0,
        BM=BLOCK_M, BL=_block_l(hd), LONG_MIN=long_min, SPLIT=scfg is not None, S=scfg.splits if scfg else 1,
        SBL=scfg.block_l if scfg else 16, MIN_TILES=scfg.min_tiles if scfg else 1, ALIGN=PIECE_ALIGN,
        num_warps=attention_warps(hd), enable_fp_fusion=False, **common,
    )  # fmt: skip
    if side is not None:
        main.wait_stream(side)
    return out


def _fmha_tier(
    tiers: tuple[LongConfig, ...], head_dim: int, dots: str, fmha: bool | None, device: torch.device
) -> LongConfig | None:
    """The tier whose own blocks the FMHA kernel takes, or None: the last tier, if wanted (`fmha`,
    None: `FMHA_LONG_TIER`) and it is unbounded, bf16 with the K/V shadow, at FMHA_HEAD_DIM.
    Wanted as None, only on CUDA where the library has the kernel. Wanted as True, on CUDA the
    library must have it: a silent fallback would give other bits than the setting promises."""
    wanted = FMHA_LONG_TIER if fmha is None else fmha
    if wanted is False or not tiers or dots != "bf16" or head_dim != FMHA_HEAD_DIM:
        return None
    last = tiers[-1]
    if last.max_length or not last.bf16_kv:
        return None
    if device.type != "cuda":
        return last if wanted else None
    from engine.kernels import cutlass_gemm

    lib = cutlass_gemm.library()
    if lib is None or not lib.has_forest_fmha:
        if wanted is None:
            return None
        raise RuntimeError(
            "FMHA_LONG_TIER needs the CUTLASS library with its FMHA unit on an sm_90 GPU (`make cutlass`)"
        )
    return last


def fmha_capacity(t: int, long_min: int) -> int:
    """Entries of the FMHA work list for T rows: at most T / FMHA_TILE whole tiles plus one partial
    tile per segment of at least long_min tokens, so the list never overflows."""
    return t // FMHA_TILE + t // long_min + 1


def fmha_plan(segs: torch.Tensor, t: int, long_min: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The FMHA tier's work list (`_fmha_plan_kernel`): tiles int32 [capacity, 4], count int32 [1]."""
    cap = fmha_capacity(t, long_min)
    tiles = torch.empty(cap, 4, dtype=torch.int32, device=segs.device)
    count = torch.empty(1, dtype=torch.int32, device=segs.device)
    _fmha_plan[(1,)](
        segs, tiles, count, segs.shape[0], cap, LONG_MIN=long_min, TILE=FMHA_TILE, CHUNK=64, num_warps=1
    )  # fmt: skip
    return tiles, count


def _fmha_queries(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q as the FMHA kernel reads it: bf16 values (dtype: bf16, or fp32 under the interpreter) with
    FMHA_PAD rows after the last. In place where the prep made them (`pad_rows`), else a copy
    rounded to nearest even (the rounding the Triton tier applies in registers)."""
    t, nh, hd = q.shape
    need = (q.storage_offset() + (t + FMHA_PAD) * nh * hd) * q.element_size()
    if q.dtype == dtype == torch.bfloat16 and q.is_contiguous() and q.untyped_storage().nbytes() >= need:
        return q
    padded = torch.empty(t + FMHA_PAD, nh, hd, dtype=dtype, device=q.device)
    padded[:t] = q.to(torch.bfloat16)
    return padded


def _fmha_own_blocks(
    q: torch.Tensor,
    k16: torch.Tensor,
    v16: torch.Tensor,
    out: torch.Tensor,
    segs: torch.Tensor,
    long_min: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """The FMHA tier's own causal blocks: plan the list, then the kernel (CUDA) or its torch
    stand-in (interpreter) writes each listed row's normalised output into out and returns the
    rows' LSE [T, nh] fp32 (rows outside the tier's segments are not written)."""
    t, nh, _ = q.shape
    tiles, count = fmha_plan(segs, t, long_min)
    lse = torch.empty(t, nh, dtype=torch.float32, device=q.device)
    qp = _fmha_queries(q, k16.dtype)
    if q.is_cuda:
        from engine.kernels import cutlass_gemm

        lib = cutlass_gemm.library()
        assert lib is not None  # `_fmha_tier` checked
        lib.forest_fmha(qp, k16, v16, out, lse, tiles, count, t)
    else:
        forest_fmha_reference(qp, k16, v16, out, lse, tiles, count)
    return lse


@functools.cache
def _tier_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the large-block tiers run on (`CONCURRENT_TIERS`), one per device. A CUDA
    graph captures the fork and the join as two branches."""
    return torch.cuda.Stream(device)


def _split_programs(device: torch.device) -> int:
    """Programs of the persistent split kernel: one per SM on CUDA (each takes every n-th unit,
    so the count decides only which SM runs a unit, never a bit), a few under the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def _launch_split(
    q: torch.Tensor,
    base: torch.Tensor,
    segs: torch.Tensor,
    pieces: torch.Tensor,
    qblocks: torch.Tensor,
    out: torch.Tensor,
    cfg: SplitConfig,
    *,
    num_kv_heads: int,
    long_min: int,
    dots: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Number the split blocks and reduce their ancestors (`_split_plan_kernel`, `_split_kernel`):
    returns the blocks' ranks and the partials (workspace) or folded results (ml, and out's
    rows) that the 16-row kernel starts from. Every buffer is sized by the tables' shapes and the
    config, so a captured graph's launches stay fixed."""
    t, nh, hd = q.shape
    group = nh // num_kv_heads
    n_qblocks = qblocks.shape[0]
    i32 = dict(dtype=torch.int32, device=q.device)
    rank = torch.empty(n_qblocks, **i32)
    order = torch.empty(n_qblocks, **i32)
    count = torch.empty(1, **i32)
    f32 = dict(dtype=torch.float32, device=q.device)
    rows = group * BLOCK_M
    ws_ml = torch.empty(cfg.capacity, num_kv_heads, cfg.splits, rows, 2, **f32)
    ws_acc = torch.empty(cfg.capacity, num_kv_heads, cfg.splits, rows, hd, **f32)
    ml = torch.empty(t, nh, 2, **f32)
    p = pieces.shape[1]
    _split_plan[(1,)](
        segs, pieces, qblocks, rank, order, count, n_qblocks,
        P=p, LONG_MIN=long_min, MIN_KEYS=cfg.min_keys, CHUNK=256, num_warps=4,
    )  # fmt: skip
    n_prog = _split_programs(q.device)
    _split[(n_prog,)](
        q, base, segs, pieces, qblocks, order, count, ws_ml, ws_acc, ml, out, n_prog, cfg.capacity,
        hd**-0.5 * _LOG2E,
        NH=nh, NKV=num_kv_heads, HD=hd, G=group, GP=next_pow2(group), BM=BLOCK_M, P=p, S=cfg.splits,
        BL=cfg.block_l, MIN_TILES=cfg.min_tiles, ALIGN=PIECE_ALIGN, DOTS=dots, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=False,
    )  # fmt: skip
    return rank, ws_ml, ws_acc, ml


# ------------------------------------------------------------------------ torch references
def forest_fmha_reference(
    q: torch.Tensor,
    k16: torch.Tensor,
    v16: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tiles: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """What `cutlass_gemm.Library.forest_fmha` computes, in fp32 torch: for each listed tile
    (segment-local tile m, first packed row, length), its rows' causal softmax over the segment's
    own keys from key 0 (k16 / v16 [rows, nkv, hd] at packed rows, q [rows, nh, hd]; bf16 values),
    the normalised output into out [rows, nh * hd] and the natural LSE of the scaled scores into
    lse [rows, nh], rows past the segment's length not written. The kernel's oracle, and its
    stand-in under the interpreter."""
    _, nkv, hd = k16.shape
    nh = q.shape[1]
    group = nh // nkv
    for m, row, length, _ in tiles[: int(count[0])].tolist():
        lo, hi = m * FMHA_TILE, min((m + 1) * FMHA_TILE, length)
        if lo >= hi:
            continue
        qs = q[row + lo : row + hi].float().transpose(0, 1)  # [nh, n, hd]
        keys = k16[row : row + hi].float().transpose(0, 1).repeat_interleave(group, dim=0)  # [nh, hi, hd]
        values = v16[row : row + hi].float().transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (qs @ keys.transpose(1, 2)) * hd**-0.5  # [nh, n, hi]
        seen = torch.arange(hi, device=q.device)[None, :] <= torch.arange(lo, hi, device=q.device)[:, None]
        scores = scores.masked_fill(~seen, float("-inf"))
        lse[row + lo : row + hi] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        o = torch.softmax(scores, dim=-1) @ values  # [nh, n, hd]
        out[row + lo : row + hi] = o.transpose(0, 1).reshape(hi - lo, nh * hd)


def forest_attention_prep_reference(
    x: PrepInputs,
    base: torch.Tensor,
    rows: torch.Tensor,
    segs: torch.Tensor,
    pieces: torch.Tensor,
    heads: AttentionHeads,
    part: str = "all",
) -> torch.Tensor:
    """`engine.run.reference` norms and RoPE row by row (own blocks inside base's storage): the oracle."""

    def own_slot(r: int) -> tuple[torch.Tensor, int] | None:
        if not int(rows[r, ROW_LIVE]):
            return None
        return pieces[int(rows[r, ROW_SEG]), -1], int(rows[r, ROW_LOCAL])

    return prep_rows_reference(x, base, heads, own_slot, part)


def forest_attention_reference(
    q: torch.Tensor,
    qg: torch.Tensor,
    base: torch.Tensor,
    rows: torch.Tensor,
    segs: torch.Tensor,
    pieces: torch.Tensor,
    qblocks: torch.Tensor,
    nkv: int,
) -> torch.Tensor:
    """Per row of each live query block: the cascade of `fold_attention_piece` over its segment's
    pieces (the own block causally), then the sigmoid gate; uncovered rows stay zero."""
    t, nh, hd = q.shape
    out = torch.zeros(t, nh * hd, dtype=torch.float32, device=q.device)
    for qb in qblocks.tolist():
        if not qb[QB_LIVE]:
            continue
        seg = qb[QB_SEG]
        tok_lo, length = int(segs[seg, SEG_TOK_LO]), int(segs[seg, SEG_LENGTH])
        for local in range(qb[QB_LOCAL], min(qb[QB_LOCAL] + BLOCK_M, length)):
            r = tok_lo + local
            out[r] = attend_row_reference(q[r], qg[r], base, pieces[seg], local + 1, nkv)
    return out
