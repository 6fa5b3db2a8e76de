"""Forest attention kernels (prep + piece attention over packed prefill tokens) against their torch
references and a plain-softmax oracle, and segment by segment: a segment's bits alone equal its
bits in a bigger launch at another slot and other packed rows.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import engine.kernels.forest_attention as fa
from engine.kernels._triton import interpreting
from engine.kernels.decode_attention import SPLITS as DECODE_SPLITS
from engine.kernels.decode_attention import AttentionHeads, PrepInputs, decode_attention
from engine.kernels.decode_rows import LIVE, THOUGHT_LEN
from engine.kernels.decode_rows import ROW_FIELDS as DECODE_ROW_FIELDS
from engine.kernels.forest_attention import (
    LongConfig,
    SplitConfig,
    _check_tiers,
    _launch_split,
    attention_warps,
    forest_attention,
    forest_attention_prep,
    long_config,
    long_configs,
    split_config,
)
from engine.kernels.forest_tables import BLOCK_M, QBLOCK_FIELDS, ROW_FIELDS, SEG_FIELDS, SEG_LIVE
from engine.run.reference import rope_cos_sin
from engine.testing.make_model import dims_config
from tests.engine.kernels.pool import Pool

CFG = dims_config("tiny")  # 4 heads, 2 KV heads, head_dim 32, rope_dims 8
NH, NKV, HD = CFG.num_attention_heads, CFG.num_kv_heads, CFG.head_dim
HEADS = AttentionHeads(NH, NKV, HD, CFG.rms_norm_eps)
QG_W, KV_W = NH * 2 * HD, NKV * HD
SLACK = 3  # own blocks hold length + SLACK rows: padding rows aim at the spare ones

# (ancestor piece lengths, oldest first, 0 = unused slot; own length): partial and multiple query
# blocks of BLOCK_M = 16, ancestors and an own block longer than one key block of 64
SEGMENTS = [([3, 0], 1), ([0, 0], 5), ([70, 7], 17), ([0, 12], 33), ([2, 0], 70)]
P = 3
# The large-block kernel's configs under test (tensor-core dots): the shipped one at this head
# size (64-row blocks from 64 tokens: the 70-token segment, one full and one partial block) and
# a small one that takes the segments of 17, 33 and 70 tokens (ancestors of 77 and 12 keys: full
# and partial key tiles, several blocks, a block of one row) while 1 and 5 keep the 16-row kernel;
# "fp32kv" is "small" rounding the fp32 own tiles in registers instead of reading the bf16 shadow,
# "anc" has own tiles of 32 keys and ancestor tiles of 16 (like the shipped 64 / 32 at head_dim 256).
LONG = {
    "shipped": True,
    "small": LongConfig(block_m=32, block_l=16, num_warps=4, min_length=17),
    "fp32kv": LongConfig(block_m=32, block_l=16, num_warps=4, min_length=17, bf16_kv=False),
    "anc": LongConfig(block_m=32, block_l=32, num_warps=4, min_length=17, ancestor_block_l=16),
    # "small" with its queries staged through the bf16 copy (same bits)
    "q16": LongConfig(block_m=32, block_l=16, num_warps=4, min_length=17, q16=True),
    # two tiers by segment length: 17 and 33 tokens in 32-row blocks, 70 in 64-row blocks over
    # 32-key tiles (ancestors 16), like `long_configs(form="tiered")` at head_dim 256
    "tiers": (
        LongConfig(block_m=32, block_l=16, num_warps=4, min_length=17, max_length=64),
        LongConfig(block_m=64, block_l=32, num_warps=4, min_length=64, ancestor_block_l=16, q16=True),
    ),
}
# The ancestor split's configs under test (bf16 dots, beside the shipped large-block config, which
# takes only the 70-token segment): 3 ranges of 16-key tiles for blocks after >= 12 ancestor keys,
# so the 17-token segment (77 keys: 5 + 1 tiles, a partial one in each piece) and the 33-token one
# (12 keys: one tile, two empty ranges) split - 5 query blocks - and the others keep their walk.
# "wide" runs every block's splits in parallel, "narrow" only the first 2 blocks' (the others fold
# their splits in one program), "serial" none.
SPLITS = {
    "wide": SplitConfig(splits=3, min_keys=12, capacity=8, block_l=16, num_warps=4),
    "narrow": SplitConfig(splits=3, min_keys=12, capacity=2, block_l=16, num_warps=4),
    "serial": SplitConfig(splits=3, min_keys=12, capacity=0, block_l=16, num_warps=4),
    # at least 3 tiles a range: the 17-token segment's 6 ancestor tiles in 2 ranges, the 33-token
    # one's single tile in 1 (and "tiles_serial" folds them all in one program: the same bits)
    "tiles": SplitConfig(splits=3, min_keys=12, capacity=8, block_l=16, num_warps=4, min_tiles=3),
    "tiles_serial": SplitConfig(splits=3, min_keys=12, capacity=0, block_l=16, num_warps=4, min_tiles=3),
}
SPLIT_SEGMENTS = (2, 3)


@dataclass
class Case:
    pool: Pool
    before: torch.Tensor  # the pool's initial contents (each run starts from them)
    pieces: list[torch.Tensor]  # per segment: its piece records [P, 4]
    acts: list[torch.Tensor]  # per segment: fused [length, qg | k | v] rows (fp32)
    rope: list[torch.Tensor]  # per segment: [length, 2, rope_dims]
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@dataclass
class Launch:
    rows: torch.Tensor
    segs: torch.Tensor
    pieces: torch.Tensor
    qblocks: torch.Tensor
    fused: torch.Tensor  # [T, qg | k | v]: qg, k, v are column slices (row stride > width)
    rope: torch.Tensor
    row_of: dict[int, int]  # segment -> its first packed row

    def inputs(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        fused = self.fused.to(dtype)
        return fused[:, :QG_W], fused[:, QG_W : QG_W + KV_W], fused[:, QG_W + KV_W :]


def _case(dev: torch.device, gen: torch.Generator) -> Case:
    block = NKV * HD
    need = sum((sum(a) + 2 * (n + SLACK)) * block * 2 + 64 for a, n in SEGMENTS)
    pool = Pool(need, dev, gen)
    pieces, acts, rope = [], [], []
    for ancestors, n in SEGMENTS:
        rec = torch.zeros(P, 4, dtype=torch.int64)
        for p, a in enumerate(ancestors):
            rec[p] = torch.tensor([pool.take(a * block), pool.take(a * block), a, a])
        cap = n + SLACK
        rec[P - 1] = torch.tensor([pool.take(cap * block), pool.take(cap * block), n, cap])
        pieces.append(rec)
        acts.append(torch.randn(n, QG_W + 2 * KV_W, generator=gen))
        cos, sin = rope_cos_sin(CFG, sum(ancestors) + torch.arange(n), torch.float32)
        rope.append(torch.stack([cos, sin], dim=1))
    q_norm = 1 + 0.1 * torch.randn(HD, generator=gen)
    k_norm = 1 + 0.1 * torch.randn(HD, generator=gen)
    return Case(pool, pool.base.clone(), pieces, acts, rope, q_norm.to(dev), k_norm.to(dev))


def _seg_record(tok_lo: int, length: int, live: int) -> list[int]:
    rec = [0] * SEG_FIELDS
    rec[0], rec[1], rec[SEG_LIVE] = tok_lo, length, live
    return rec


def _launch(case: Case, members: list[int], dev: torch.device, *, spread: bool) -> Launch:
    """Tables for segments `members`. Not spread: slots 0.., rows from 0, nothing else. Spread:
    slots reversed after a padding slot, padding rows before and between segments (aimed at spare
    rows of own blocks), a padding slot, dead query blocks and a shuffled block order."""
    rows: list[list[int]] = []
    segs: list[list[int]] = []
    pieces: list[torch.Tensor] = []
    blocks: list[list[int]] = []
    fused: list[torch.Tensor] = []
    rope: list[torch.Tensor] = []
    row_of: dict[int, int] = {}
    gen = torch.Generator().manual_seed(7)

    def pad_rows(count: int, slot: int, spare: int) -> None:
        for _ in range(count):
            rows.append([slot, spare, 0, 0])
            fused.append(torch.randn(1, QG_W + 2 * KV_W, generator=gen))
            rope.append(torch.randn(1, 2, CFG.rope_dims, generator=gen))

    order = list(reversed(members)) if spread else list(members)
    if spread:  # slot 0: padding, its rows 0 .. 2 padding too
        segs.append(_seg_record(0, 3, 0))
        pieces.append(torch.zeros(P, 4, dtype=torch.int64))
        blocks.append([0, 0, 0])
        pad_rows(3, 1, SEGMENTS[order[0]][1] + 1)
    for s in order:
        slot, n = len(segs), SEGMENTS[s][1]
        row_of[s] = len(rows)
        segs.append(_seg_record(len(rows), n, 1))
        pieces.append(case.pieces[s])
        rows += [[slot, i, 1, 0] for i in range(n)]
        fused.append(case.acts[s])
        rope.append(case.rope[s])
        blocks += [[slot, lo, 1] for lo in range(0, n, BLOCK_M)]
        if spread:
            pad_rows(2, slot, n + SLACK - 1)
            blocks.append([slot, 0, 0])
    if spread:
        segs.append(_seg_record(0, 2, 0))
        pieces.append(torch.zeros(P, 4, dtype=torch.int64))
        random.Random(3).shuffle(blocks)
        blocks += [[len(segs) - 1, 0, 0], [0, 0, 0]]
    i64 = dict(dtype=torch.int64, device=dev)
    return Launch(
        rows=torch.tensor(rows, **i64).view(-1, ROW_FIELDS),
        segs=torch.tensor(segs, **i64).view(-1, SEG_FIELDS),
        pieces=torch.stack(pieces).to(dev),
        qblocks=torch.tensor(blocks, **i64).view(-1, QBLOCK_FIELDS),
        fused=torch.cat(fused).to(dev),
        rope=torch.cat(rope).to(dev),
        row_of=row_of,
    )


def _prep(case: Case, lay: Launch, backend: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = PrepInputs(*lay.inputs(dtype), case.q_norm, case.k_norm, lay.rope)
    return forest_attention_prep(x, case.pool.base, lay.rows, lay.segs, lay.pieces, HEADS, backend=backend)


def _attend(
    case: Case,
    lay: Launch,
    q: torch.Tensor,
    backend: str,
    dots: str = "ieee",
    long: LongConfig | bool = True,
    split: SplitConfig | bool = True,
) -> torch.Tensor:
    qg = lay.inputs()[0]
    base = case.pool.base
    return forest_attention(
        q, qg, base, lay.rows, lay.segs, lay.pieces, lay.qblocks, num_kv_heads=NKV, dots=dots, long=long,
        split=split, backend=backend,
    )  # fmt: skip


def _own_block(case: Case, s: int) -> tuple[slice, slice]:
    k_off, v_off, _, cap = case.pieces[s][P - 1].tolist()
    return slice(k_off, k_off + NKV * cap * HD), slice(v_off, v_off + NKV * cap * HD)


def _written(case: Case, lay: Launch) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks over base of the key and value elements live rows store."""
    kmask = torch.zeros(case.pool.base.numel(), dtype=torch.bool)
    vmask = torch.zeros_like(kmask)
    for s in lay.row_of:
        n, cap = SEGMENTS[s][1], SEGMENTS[s][1] + SLACK
        ks, vs = _own_block(case, s)
        kmask[ks].view(NKV, cap, HD)[:, :n] = True
        vmask[vs].view(NKV, cap, HD)[:, :n] = True
    return kmask.to(case.pool.base.device), vmask.to(case.pool.base.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prep_matches_reference_and_padding_writes_nothing(
    dtype: torch.dtype, dev: torch.device, gen: torch.Generator
) -> None:
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "triton", dtype)
    after_kernel = case.pool.base.clone()
    case.pool.base.copy_(case.before)
    q_ref = _prep(case, lay, "torch", dtype)
    after_ref = case.pool.base
    # rms_norm's sum of squares and rsqrt are not torch's ops in torch's order: rounding differs
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-6)
    kmask, vmask = _written(case, lay)
    torch.testing.assert_close(after_kernel[kmask], after_ref[kmask], rtol=1e-5, atol=1e-6)
    v = lay.inputs(dtype)[2].float()
    for s, row0 in lay.row_of.items():  # values are stored as they come
        n = SEGMENTS[s][1]
        stored = after_kernel[_own_block(case, s)[1]].view(NKV, n + SLACK, HD)[:, :n]
        assert torch.equal(stored, v[row0 : row0 + n].view(n, NKV, HD).transpose(0, 1)), s
    rest = ~(kmask | vmask)  # padding rows aim at spare rows of own blocks: those stay as they were
    assert torch.equal(after_kernel[rest], case.before[rest])
    assert torch.equal(after_ref[rest], case.before[rest])


def _oracle(
    case: Case,
    lay: Launch,
    q: torch.Tensor,
    *,
    rounded: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
    operand_unit: float = 0.0,
    weight_unit: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax of each row over [ancestors..., own[:l + 1]], gated; uncovered rows zero.
    q, keys and values pass through `rounded` first (the dot format's rounding, where emulated).

    Also a bound per output element on what rounding the dot operands can change beyond that:
    q and k of unit roundoff `operand_unit` move a score by at most d = scale |q|.|k| 2u(1+u),
    so each softmax weight p_j by a factor within exp(+-2d); rounding the weights (and v, if
    not emulated) to `weight_unit` moves each term by at most 2u(1+u):
    |change| <= (expm1(2d) + 2u(1+u)) sum_j p_j |v_j| (the gate is <= 1).
    """
    base = case.pool.base
    out = torch.zeros(q.shape[0], NH * HD, device=q.device)
    bound = torch.zeros_like(out)
    qg = lay.inputs()[0]
    q = rounded(q)
    for s, row0 in lay.row_of.items():
        keys, values = [], []
        for k_off, v_off, n, rows_per_head in case.pieces[s].tolist():
            shape = (NKV, rows_per_head, HD)
            keys.append(base[k_off : k_off + NKV * rows_per_head * HD].view(shape)[:, :n])
            values.append(base[v_off : v_off + NKV * rows_per_head * HD].view(shape)[:, :n])
        ancestors = sum(SEGMENTS[s][0])
        # [nh, ancestors + n, hd]
        k_all = rounded(torch.cat(keys, dim=1)).repeat_interleave(NH // NKV, dim=0)
        v_all = rounded(torch.cat(values, dim=1)).repeat_interleave(NH // NKV, dim=0)
        for local in range(SEGMENTS[s][1]):
            r, seen = row0 + local, ancestors + local + 1
            scores = torch.einsum("hd,hld->hl", q[r], k_all[:, :seen]) * HD**-0.5
            p = torch.softmax(scores, dim=-1)
            o = torch.einsum("hl,hld->hd", p, v_all[:, :seen])
            out[r] = (o * torch.sigmoid(qg[r].view(NH, 2 * HD)[:, HD:])).reshape(-1)
            qk = torch.einsum("hd,hld->hl", q[r].abs(), k_all[:, :seen].abs()).amax(dim=1)
            d = qk * HD**-0.5 * 2 * operand_unit * (1 + operand_unit)
            rel = 2 * weight_unit * (1 + weight_unit)
            v_abs = torch.einsum("hl,hld->hd", p, v_all[:, :seen].abs())
            bound[r] = ((torch.expm1(2 * d) + rel)[:, None] * v_abs).reshape(-1)
    return out, bound


def test_attention_matches_reference_and_oracle(dev: torch.device, gen: torch.Generator) -> None:
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    out = _attend(case, lay, q, "triton")
    out_ref = _attend(case, lay, q, "torch")
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, _oracle(case, lay, q)[0], rtol=1e-5, atol=1e-5)
    covered = torch.zeros(q.shape[0], dtype=torch.bool, device=dev)
    for s, row0 in lay.row_of.items():
        covered[row0 : row0 + SEGMENTS[s][1]] = True
    assert torch.equal(out[~covered], torch.zeros_like(out[~covered]))  # padding rows, dead blocks
    assert torch.equal(out_ref[~covered], torch.zeros_like(out_ref[~covered]))
    assert out[covered].abs().amin(dim=1).gt(0).all()


def _garbage_output(t: int, width: int, device: torch.device) -> torch.Tensor:
    """What an uninitialized output may hold: NaN everywhere."""
    return torch.full((t, width), float("nan"), device=device)


@pytest.mark.parametrize(
    ("dots", "long", "split"),
    [
        ("ieee", False, False),
        ("bf16", "tiers", False),
        ("bf16", "shipped", "wide"),
        ("bf16", "small", "narrow"),
        ("bf16", "small", "serial"),
    ],
)
def test_only_dead_rows_zeroed_gives_the_zero_filled_outputs_bits(
    dots: str, long: str | bool, split: str | bool, dev: torch.device, gen: torch.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`ZERO_DEAD_ROWS_ONLY`: the output starts as garbage (NaN here, whatever the allocator
    gives) and only the rows the table marks dead are zeroed, so every live row must be written
    whole by the kernel serving its block (the 16-row kernel, a tier, the split's first fold).
    The oracle is the zero-filled output: equal bit for bit, padding rows and the rows of dead
    blocks' segments included, for the 16-row kernel alone, the tiers, and the split."""
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    tier = LONG[long] if isinstance(long, str) else long
    cut = SPLITS[split] if isinstance(split, str) else split
    zero_filled = _attend(case, lay, q, "triton", dots, tier, cut)
    monkeypatch.setattr(fa, "ZERO_DEAD_ROWS_ONLY", True)
    monkeypatch.setattr(fa, "_output", _garbage_output)
    dead_zeroed = _attend(case, lay, q, "triton", dots, tier, cut)
    assert not dead_zeroed.isnan().any()
    assert torch.equal(dead_zeroed, zero_filled)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B head shape runs compiled, on CUDA")
@pytest.mark.parametrize("segments", ["split", "tiers"])
def test_27b_only_dead_rows_zeroed_gives_the_zero_filled_outputs_bits(
    segments: str, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same at the 27B heads, compiled: a split question and both tiers, padding rows."""
    run, _ = _big_case(SPLIT_BIG_SEGMENTS if segments == "split" else TIER_BIG_SEGMENTS, "bf16", gen)
    zero_filled, _ = run([2, 0, 1], pad=8)
    monkeypatch.setattr(fa, "ZERO_DEAD_ROWS_ONLY", True)
    monkeypatch.setattr(fa, "_output", _garbage_output)
    dead_zeroed, _ = run([2, 0, 1], pad=8)
    assert not dead_zeroed.isnan().any()
    assert torch.equal(dead_zeroed, zero_filled)


def _to_bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()  # round to nearest even, as the kernel's bf16 operands


# bf16: q, k, v rounded here as the kernel rounds them, leaving its probabilities (8-bit
# significand: unit 2^-8); tf32 (11-bit significand, 2^-10 also covers truncation) not emulated
TENSOR_CORE_ORACLE: dict[str, dict] = {
    "bf16": dict(rounded=_to_bf16, weight_unit=2.0**-8),
    "tf32": dict(operand_unit=2.0**-10, weight_unit=2.0**-10),
}


@pytest.mark.parametrize("long", sorted(LONG))
@pytest.mark.parametrize("dots", sorted(TENSOR_CORE_ORACLE))
def test_tensor_core_dots_within_their_rounding_bound(
    dots: str, long: str, dev: torch.device, gen: torch.Generator
) -> None:
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    out = _attend(case, lay, q, "triton", dots, LONG[long])
    want, bound = _oracle(case, lay, q, **TENSOR_CORE_ORACLE[dots])
    err = (out - want).abs()
    assert (err <= bound + 1e-5).all(), f"{dots}: error {err.max():.3g} over its bound"


@pytest.mark.parametrize("dots", ["bf16"])
def test_long_segments_take_the_large_block_kernel_and_short_ones_keep_theirs(
    dots: str, dev: torch.device, gen: torch.Generator
) -> None:
    """Under tensor-core dots only segments of at least min_length tokens change kernel: the
    others' bits equal the 16-row kernel's (long=False); every covered row gets an output."""
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    cfg = LONG["small"]
    assert isinstance(cfg, LongConfig)
    old = _attend(case, lay, q, "triton", dots, False)
    new = _attend(case, lay, q, "triton", dots, cfg)
    changed = 0
    for s, row0 in lay.row_of.items():
        rows = slice(row0, row0 + SEGMENTS[s][1])
        assert new[rows].abs().amin(dim=1).gt(0).all(), s
        if SEGMENTS[s][1] < cfg.min_length:
            assert torch.equal(new[rows], old[rows]), s
        else:
            changed += not torch.equal(new[rows], old[rows])
    assert changed  # another tile order rounds differently somewhere: the large kernel ran
    assert torch.equal(_attend(case, lay, q, "triton", "ieee", cfg), _attend(case, lay, q, "triton", "ieee"))


def test_bf16_shadow_gives_the_in_register_rounding_bits(dev: torch.device, gen: torch.Generator) -> None:
    """The bf16 shadow of the own K/V rounds as the kernel rounds fp32 tiles in registers, so the
    two paths agree bit for bit (interpreter; compiled, the same wgmma sequence is expected)."""
    if dev.type == "cuda":
        pytest.skip("bit equality of the two load paths is checked through the interpreter")
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    assert torch.equal(_attend(case, lay, q, "triton", "bf16", LONG["small"]),
                       _attend(case, lay, q, "triton", "bf16", LONG["fp32kv"]))  # fmt: skip


def test_q16_and_tiers_move_only_what_they_should(dev: torch.device, gen: torch.Generator) -> None:
    """q16 changes where the rounded queries are kept, not their values: the bits of "small".
    Tiers: each segment gets the bits of its tier's config applied alone (the 17- and 33-token
    segments those of the 32-row tier, the 70-token one those of the 64-row tier)."""
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    small = _attend(case, lay, q, "triton", "bf16", LONG["small"])
    assert torch.equal(_attend(case, lay, q, "triton", "bf16", LONG["q16"]), small)
    tiers = _attend(case, lay, q, "triton", "bf16", LONG["tiers"])
    short, big = LONG["tiers"]
    alone_big = _attend(case, lay, q, "triton", "bf16", dataclasses.replace(big, min_length=17))
    for s, row0 in lay.row_of.items():
        rows = slice(row0, row0 + SEGMENTS[s][1])
        want = small if SEGMENTS[s][1] < big.min_length else alone_big
        assert torch.equal(tiers[rows], want[rows]), s


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bf16_queries_give_the_bits_of_fp32_ones(
    backend: str, dev: torch.device, gen: torch.Generator
) -> None:
    """The prep's bf16 queries are its fp32 queries rounded to nearest even (`_bf16_operand`'s
    rounding, here and compiled); under bf16 dots every attention kernel (the 16-row one, the
    large-block tiers with and without q16, the ancestor split) gives them the fp32 queries'
    bits, since it rounds each query so before its first product. Other dots refuse them."""
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    x = PrepInputs(*lay.inputs(), case.q_norm, case.k_norm, lay.rope)
    prep = dict(rows=lay.rows, segs=lay.segs, pieces=lay.pieces, heads=HEADS, backend=backend)
    q32 = forest_attention_prep(x, case.pool.base, **prep)
    q16 = forest_attention_prep(x, case.pool.base, q_dtype=torch.bfloat16, **prep)
    assert q16.dtype == torch.bfloat16 and torch.equal(q16, q32.bfloat16())
    if backend == "torch":
        return
    for long in ("small", "q16", "tiers"):
        for split in (False, True):
            want = _attend(case, lay, q32, "triton", "bf16", LONG[long], split)
            assert torch.equal(_attend(case, lay, q16, "triton", "bf16", LONG[long], split), want), (
                long,
                split,
            )
    with pytest.raises(ValueError, match="bf16 queries are for bf16 dots"):
        _attend(case, lay, q16, "triton", "ieee")


def test_long_config_is_checked() -> None:
    with pytest.raises(ValueError, match="block_m must be a multiple"):
        LongConfig(block_m=48, block_l=32, num_warps=4, min_length=64)
    with pytest.raises(ValueError, match="min_length"):
        LongConfig(block_m=64, block_l=32, num_warps=4, min_length=0)
    with pytest.raises(ValueError, match="ancestor_block_l"):
        LongConfig(block_m=64, block_l=32, num_warps=4, min_length=64, ancestor_block_l=24)
    for hd in (32, 256):
        for dots in ("bf16", "tf32"):
            cfg = long_config(hd, dots)
            assert cfg.min_length >= cfg.block_m  # a long segment fills at least one block


def test_long_tiers_are_checked() -> None:
    with pytest.raises(ValueError, match="max_length"):
        LongConfig(block_m=32, block_l=16, num_warps=4, min_length=64, max_length=64)
    short, big = LONG["tiers"]
    with pytest.raises(ValueError, match="tier bounds"):
        _check_tiers((short, dataclasses.replace(big, min_length=80)))
    with pytest.raises(ValueError, match="last tier"):
        _check_tiers((short,))
    with pytest.raises(ValueError, match="form must be"):
        long_configs(256, "bf16", "fast")
    for hd in (32, 256):
        assert long_configs(hd, "bf16", "s10") == (long_config(hd),)
        tiers = long_configs(hd, "bf16", "tiered")
        _check_tiers(tiers)
        assert tiers[0].min_length == long_config(hd).min_length  # the same segments go long
        assert all(c.min_length >= c.block_m for c in tiers)
        assert long_configs(hd, "tf32", "tiered") == (long_config(hd, "tf32"),)


def test_split_config_is_checked() -> None:
    with pytest.raises(ValueError, match="splits and min_keys"):
        SplitConfig(splits=0, min_keys=16, capacity=1)
    with pytest.raises(ValueError, match="capacity"):
        SplitConfig(splits=2, min_keys=16, capacity=-1)
    with pytest.raises(ValueError, match="block_l"):
        SplitConfig(splits=2, min_keys=16, capacity=1, block_l=24)
    with pytest.raises(ValueError, match="min_tiles"):
        SplitConfig(splits=2, min_keys=16, capacity=1, min_tiles=0)
    for hd in (32, 256):
        cfg = split_config(hd, "bf16")
        assert cfg is not None and cfg.min_keys >= cfg.splits * cfg.block_l  # no empty range
        assert split_config(hd, "tf32") is None and split_config(hd, "ieee") is None


def test_split_blocks_are_the_short_blocks_after_long_ancestors(
    dev: torch.device, gen: torch.Generator
) -> None:
    """The plan kernel's ranks against the rule computed here: a live block of a segment shorter
    than the large-block kernel's minimum whose ancestors hold >= min_keys keys, numbered in
    table order."""
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    cfg = SPLITS["narrow"]
    out = torch.zeros(q.shape[0], NH * HD, device=dev)
    long_min = long_config(HD).min_length
    rank, *_ = _launch_split(
        q, case.pool.base, lay.segs, lay.pieces, lay.qblocks, out, cfg, num_kv_heads=NKV, long_min=long_min,
        dots="bf16",
    )  # fmt: skip
    want, next_rank = [], 0
    for slot, _, live in lay.qblocks.tolist():
        keys = int(lay.pieces[slot, :-1, 2].sum())
        if live and keys >= cfg.min_keys and int(lay.segs[slot, 1]) < long_min:
            want.append(next_rank)
            next_rank += 1
        else:
            want.append(-1)
    assert rank.tolist() == want
    assert next_rank == sum(-(-SEGMENTS[s][1] // BLOCK_M) for s in SPLIT_SEGMENTS)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_split_within_its_rounding_bound(split: str, dev: torch.device, gen: torch.Generator) -> None:
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    out = _attend(case, lay, q, "triton", "bf16", True, SPLITS[split])
    want, bound = _oracle(case, lay, q, **TENSOR_CORE_ORACLE["bf16"])
    err = (out - want).abs()
    assert (err <= bound + 1e-5).all(), f"{split}: error {err.max():.3g} over its bound"


def test_split_changes_only_the_split_segments(dev: torch.device, gen: torch.Generator) -> None:
    """Segments without long ancestors keep the bits of the walk (split=False); the split ones
    change (another reduction order); ieee and tf32 ignore the split; and the capacity - which
    blocks run their splits in parallel - changes no bit."""
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    old = _attend(case, lay, q, "triton", "bf16", True, False)
    new = {name: _attend(case, lay, q, "triton", "bf16", True, cfg) for name, cfg in SPLITS.items()}
    changed = 0
    for s, row0 in lay.row_of.items():
        rows = slice(row0, row0 + SEGMENTS[s][1])
        assert new["wide"][rows].abs().amin(dim=1).gt(0).all(), s
        if s in SPLIT_SEGMENTS:
            changed += not torch.equal(new["wide"][rows], old[rows])
        else:
            assert torch.equal(new["wide"][rows], old[rows]), s
    assert changed  # another reduction order rounds differently somewhere: the split ran
    assert torch.equal(new["narrow"], new["wide"])
    assert torch.equal(new["serial"], new["wide"])
    assert torch.equal(new["tiles_serial"], new["tiles"])
    # fewer ranges only for the 17-token segment (6 tiles: 2 ranges of 3 instead of 3 of 2); the
    # 33-token one's single tile is one range either way
    r3 = slice(lay.row_of[3], lay.row_of[3] + SEGMENTS[3][1])
    assert torch.equal(new["tiles"][r3], new["wide"][r3])
    r2 = slice(lay.row_of[2], lay.row_of[2] + SEGMENTS[2][1])
    assert not torch.equal(new["tiles"][r2], new["wide"][r2])  # other ranges round differently: it ran
    for s, row0 in lay.row_of.items():
        if s not in SPLIT_SEGMENTS:
            rows = slice(row0, row0 + SEGMENTS[s][1])
            assert torch.equal(new["tiles"][rows], old[rows]), s
    for dots in ("ieee", "tf32"):
        assert torch.equal(
            _attend(case, lay, q, "triton", dots, True, SPLITS["wide"]),
            _attend(case, lay, q, "triton", dots, True),
        )


def test_unknown_dots_raise(dev: torch.device, gen: torch.Generator) -> None:
    case = _case(dev, gen)
    lay = _launch(case, [1], dev, spread=False)
    q = _prep(case, lay, "torch")
    with pytest.raises(ValueError, match="dots must be one of"):
        _attend(case, lay, q, "triton", "fp16")


@pytest.mark.parametrize(
    ("dots", "long", "split"), [("ieee", "shipped", ""), ("tf32", "shipped", ""), ("bf16", "shipped", ""),
                                ("tf32", "small", ""), ("bf16", "small", ""), ("bf16", "anc", ""),
                                ("bf16", "shipped", "wide"), ("bf16", "shipped", "narrow"),
                                ("bf16", "tiers", "tiles")]
)  # fmt: skip
def test_segment_bits_do_not_depend_on_the_launch(
    dots: str, long: str, split: str, dev: torch.device, gen: torch.Generator
) -> None:
    """Under "narrow" the packed launch has 5 split blocks, 3 past the capacity, and a segment alone
    at most 3: blocks change between parallel splits and one folding program."""
    case = _case(dev, gen)
    members = list(range(len(SEGMENTS)))
    big = _launch(case, members, dev, spread=True)
    case.pool.base.copy_(case.before)
    q_big = _prep(case, big, "triton")
    splitting = SPLITS.get(split, False)
    out_big = _attend(case, big, q_big, "triton", dots, LONG[long], splitting)
    base_big = case.pool.base.clone()
    for s in members:
        alone = _launch(case, [s], dev, spread=False)
        case.pool.base.copy_(case.before)
        q = _prep(case, alone, "triton")
        out = _attend(case, alone, q, "triton", dots, LONG[long], splitting)
        rows = slice(big.row_of[s], big.row_of[s] + SEGMENTS[s][1])
        assert torch.equal(q, q_big[rows]), s
        assert torch.equal(out, out_big[rows]), s
        for block in _own_block(case, s):
            assert torch.equal(case.pool.base[block], base_big[block]), s


def test_misaligned_piece_offsets_raise_on_cpu(dev: torch.device, gen: torch.Generator) -> None:
    """The kernels declare piece offsets multiples of PIECE_ALIGN (16-byte K/V loads when
    compiled): CPU tables are checked, since the interpreter would read them right anyway."""
    if dev.type == "cuda":
        pytest.skip("CUDA tables are not read back")
    case = _case(dev, gen)
    lay = _launch(case, [2], dev, spread=False)
    q = _prep(case, lay, "torch")
    assert fa.PIECE_ALIGN > 1 and not bool((lay.pieces[..., :2] % fa.PIECE_ALIGN).any())  # the pool's
    lay.pieces[0, 0, 0] += 1
    with pytest.raises(ValueError, match="multiples of"):
        _attend(case, lay, q, "triton")


def _read_rows(lay: Launch, dev: torch.device) -> list[int]:
    """The packed rows a body would read: each segment's last row, and a middle one of the
    longest (a row whose own keys stop inside its query block and a key block)."""
    reads = [row0 + SEGMENTS[s][1] - 1 for s, row0 in lay.row_of.items()]
    longest = max(lay.row_of, key=lambda s: SEGMENTS[s][1])
    return [*reads, lay.row_of[longest] + 40]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_keys_and_queries_parts_give_the_whole_preps_bits(
    backend: str, dev: torch.device, gen: torch.Generator
) -> None:
    """`part="keys"` over every row stores exactly what the whole prep stores (and nothing else);
    `part="queries"` over some rows (their own rows table) makes exactly their queries of the
    whole prep and stores nothing: the body's last layer splits its prep this way."""
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q_all = _prep(case, lay, backend)
    stored = case.pool.base.clone()
    qg, k, v = lay.inputs()
    x = PrepInputs(qg, k, v, case.q_norm, case.k_norm, lay.rope)
    case.pool.base.copy_(case.before)
    none = forest_attention_prep(
        x, case.pool.base, lay.rows, lay.segs, lay.pieces, HEADS, part="keys", backend=backend
    )
    assert none.shape == (lay.rows.shape[0], 0, HD)
    assert torch.equal(case.pool.base, stored)
    case.pool.base.copy_(case.before)
    reads = torch.tensor(_read_rows(lay, dev), device=dev)
    at = PrepInputs(qg[reads], k[:1], v[:1], case.q_norm, case.k_norm, lay.rope[reads])
    q = forest_attention_prep(
        at, case.pool.base, lay.rows[reads], lay.segs, lay.pieces, HEADS, part="queries", backend=backend
    )
    assert torch.equal(q, q_all[reads])
    assert torch.equal(case.pool.base, case.before)
    with pytest.raises(ValueError, match="part must be one of"):
        forest_attention_prep(x, case.pool.base, lay.rows, lay.segs, lay.pieces, HEADS, part="values")


def _decode_reads(
    case: Case, lay: Launch, reads: list[int], dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-row tables of packed rows `reads` (+ one padding row): the row's local index as
    its thought length (own keys 0 .. local) and its segment's pieces, as the body builds them."""
    drows = torch.zeros(len(reads) + 1, DECODE_ROW_FIELDS, dtype=torch.int64)
    pieces = torch.zeros(len(reads) + 1, P, 4, dtype=torch.int64)
    for j, r in enumerate(reads):
        slot, local = lay.rows[r, 0].item(), lay.rows[r, 1].item()
        drows[j, THOUGHT_LEN], drows[j, LIVE] = local, 1
        pieces[j] = lay.pieces[slot].cpu()
    return drows.to(dev), pieces.to(dev)


@pytest.mark.parametrize("dots", ["ieee", "bf16"])
def test_a_read_row_through_the_decode_kernel_gets_the_forest_kernels_bits(
    dots: str, dev: torch.device, gen: torch.Generator
) -> None:
    """The body's last layer attends its read rows in the decode kernel: unsplit, with the forest
    kernel's warps, it runs the 16-row forest kernel's operations on a segment's last row (the
    row a body reads) in the same order - the same bits in the interpreter (its dots are numpy's,
    row by row); on CUDA the two builds may lay their reductions out differently, so there: the
    reference's tolerance. A row inside its query block (the last entry of `_read_rows`) is held
    to the tolerance everywhere: the forest kernel loads the block's keys past that row and masks
    their scores, the decode kernel never loads them, so the interpreter's dots see other operands
    (seen: 1 ulp). Split (the decoder's SPLITS), other fold order: within the tolerance. A
    padding row (live 0) gets zeros."""
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    want = _attend(case, lay, q, "triton", dots, long=False, split=False)  # the 16-row kernel
    reads = _read_rows(lay, dev)
    drows, dpieces = _decode_reads(case, lay, reads, dev)
    idx = torch.tensor([*reads, 0], device=dev)
    qg = lay.inputs()[0][idx]
    for splits in (1, DECODE_SPLITS):
        got = decode_attention(
            q[idx], qg, case.pool.base, drows, dpieces, num_kv_heads=NKV, splits=splits, dots=dots,
            num_warps=attention_warps(HD),
        )  # fmt: skip
        assert torch.equal(got[-1], torch.zeros_like(got[-1]))
        last_rows = len(reads) - 1  # every segment's last row; then the row inside its block
        if splits == 1 and interpreting():
            assert torch.equal(got[:last_rows], want[idx[:last_rows]])
        tol = 1e-5 if dots == "ieee" else 2e-2  # bf16 operands: the probabilities' rounding
        torch.testing.assert_close(got[:-1], want[idx[:-1]], rtol=tol, atol=tol)


def test_bad_tables_raise(dev: torch.device, gen: torch.Generator) -> None:
    case = _case(dev, gen)
    lay = _launch(case, [1], dev, spread=True)
    q = _prep(case, lay, "triton")
    qg, k, v = lay.inputs()

    def prep(**over: torch.Tensor) -> None:
        a = dict(rows=lay.rows, segs=lay.segs, pieces=lay.pieces, rope=lay.rope, k=k) | over
        x = PrepInputs(qg, a["k"], v, case.q_norm, case.k_norm, a["rope"])
        forest_attention_prep(x, case.pool.base, a["rows"], a["segs"], a["pieces"], HEADS)

    def attend(**over: torch.Tensor) -> None:
        a = dict(q=q, qg=qg, rows=lay.rows, segs=lay.segs, pieces=lay.pieces, qblocks=lay.qblocks) | over
        forest_attention(
            a["q"], a["qg"], case.pool.base, a["rows"], a["segs"], a["pieces"], a["qblocks"],
            num_kv_heads=NKV,
        )  # fmt: skip

    with pytest.raises(ValueError, match=r"rows must be int64 \[\d+, 4\]"):
        prep(rows=lay.rows.int())
    with pytest.raises(ValueError, match=r"rows must be int64 \[\d+, 4\]"):
        attend(rows=lay.rows[1:])
    with pytest.raises(ValueError, match="rows must be contiguous"):
        prep(rows=lay.rows.t().contiguous().t())
    with pytest.raises(ValueError, match=r"segs must be int64 \[\?, 8\]"):
        attend(segs=lay.segs[:, :7].contiguous())
    with pytest.raises(ValueError, match=r"pieces must be int64 \[3, \?, 4\]"):
        prep(pieces=lay.pieces[:2])
    with pytest.raises(ValueError, match="at least one piece"):
        attend(pieces=lay.pieces[:, :0].contiguous())
    with pytest.raises(ValueError, match=r"qblocks must be int64 \[\?, 3\]"):
        attend(qblocks=lay.qblocks[:, :2].contiguous())
    with pytest.raises(ValueError, match=r"qblocks must be int64"):
        attend(qblocks=lay.qblocks.float())
    with pytest.raises(ValueError, match="rope must be fp32"):
        prep(rope=lay.rope.double())
    with pytest.raises(ValueError, match="k must be"):
        prep(k=k[:, :-1])
    with pytest.raises(ValueError, match="q must be fp32"):
        attend(q=q.double())
    with pytest.raises(ValueError, match="qg must be"):
        attend(qg=qg[:, :-2])


# ------------------------------------------------------------------ the 27B head shape (CUDA only)
# 24 query heads over 4 KV heads of 256: the shipped large-block config at its real size. Segments
# (length, parent index): a long root, a short and a long child of it (the long child reads the
# root as its ancestor piece), so both kernels and the chain run in one launch.
BIG_NH, BIG_NKV, BIG_HD = 24, 4, 256
BIG_SEGMENTS = [(300, -1), (40, 0), (200, 0)]


def _big_tables(
    members: list[int],
    kv: list[list[int]],
    dev: torch.device,
    pad: int,
    segments: list[tuple[int, int]] = BIG_SEGMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict[int, int]]:
    """rows, segs, pieces [S, 2, 4], qblocks of `members` of `segments` packed after `pad` padding
    rows (and a padding slot first when pad > 0); kv[s] is segment s's own piece record."""
    rows, segs, pieces, blocks, row_of = [[0, 0, 0, 0]] * pad, [], [], [], {}
    if pad:
        segs.append(_seg_record(0, pad, 0))
        pieces.append([[0, 0, 0, 0], [0, 0, 0, 0]])
    for s in members:
        slot, (n, parent) = len(segs), segments[s]
        row_of[s] = len(rows)
        segs.append(_seg_record(len(rows), n, 1))
        pieces.append([kv[parent] if parent >= 0 else [0, 0, 0, 0], kv[s]])
        rows += [[slot, i, 1, 0] for i in range(n)]
        blocks += [[slot, lo, 1] for lo in range(0, n, BLOCK_M)]
        rows += [[0, 0, 0, 0]] * pad
    if pad:
        blocks = blocks[::-1] + [[0, 0, 0]]
    i64 = dict(dtype=torch.int64, device=dev)
    return (
        torch.tensor(rows, **i64),
        torch.tensor(segs, **i64),
        torch.tensor(pieces, **i64),
        torch.tensor(blocks, **i64),
        row_of,
    )


BigRun = Callable[..., tuple[torch.Tensor, dict[int, int]]]


def _big_case(
    segments: list[tuple[int, int]], dots: str, gen: torch.Generator
) -> tuple[BigRun, torch.Tensor]:
    """The 27B-head data on CUDA for `segments` (length, parent): every segment's own K/V block
    in one base, bf16-representable (the kernel's operand rounding is then exact, leaving the
    weights'), and `run(members, pad, **forest_attention keywords)` packing the members' rows
    (each carrying the same data wherever it lies) -> (out, first row of each member)."""
    dev = torch.device("cuda")
    block = BIG_NKV * BIG_HD
    kv, off = [], 0
    for n, _ in segments:
        kv.append([off, off + n * block, n, n])
        off += 2 * n * block
    base = torch.randn(off, generator=gen).bfloat16().float().to(dev)
    t_max = sum(n for n, _ in segments) + 8 * (len(segments) + 1)
    q_all = torch.randn(t_max, BIG_NH, BIG_HD, generator=gen).bfloat16().float().to(dev)
    qg_all = torch.randn(t_max, BIG_NH * 2 * BIG_HD, generator=gen).to(dev)

    def run(
        members: list[int], pad: int, q_dtype: torch.dtype = torch.float32, **kw: object
    ) -> tuple[torch.Tensor, dict[int, int]]:
        rows, segs, pieces, qblocks, row_of = _big_tables(members, kv, dev, pad, segments)
        t = rows.shape[0]
        q, qg = q_all[:t].clone(), qg_all[:t].clone()
        for s, r in row_of.items():
            n = segments[s][0]
            src = sum(m for m, _ in segments[:s])
            q[r : r + n], qg[r : r + n] = q_all[src : src + n], qg_all[src : src + n]
        out = forest_attention(
            q.to(q_dtype), qg, base, rows, segs, pieces, qblocks, num_kv_heads=BIG_NKV, dots=dots, **kw
        )
        return out, row_of

    return run, base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B head shape runs compiled, on CUDA")
@pytest.mark.parametrize("dots", ["bf16", "tf32"])
def test_27b_heads_alone_equals_packed_and_within_bound(dots: str, gen: torch.Generator) -> None:
    run, base = _big_case(BIG_SEGMENTS, dots, gen)
    packed, row_of = run([2, 0, 1], pad=8)
    want, _ = run([2, 0, 1], pad=8, backend="torch")
    for s, (n, _) in enumerate(BIG_SEGMENTS):
        alone, _ = run([s], pad=0)
        assert torch.equal(alone[:n], packed[row_of[s] : row_of[s] + n]), s
    # bf16 values are tf32 values too, so only the weights are rounded: to bf16 or tf32, which
    # moves each output by at most 2u(1 + u) sum_j p_j |v_j| <= 2u(1 + u) max |v| (gate <= 1)
    unit = 2.0**-8 if dots == "bf16" else 2.0**-10  # tf32: 2^-10 covers truncation too
    bound = 2 * unit * (1 + unit) * float(base.abs().max())
    err = (packed - want).abs().max()
    assert err <= bound + 1e-5, f"{dots}: {err:.3g} over {bound:.3g}"


# The ancestor split at its real size: a 1,100-token root (the large-block kernel) and two
# questions after it (3 and 2 query blocks over 1,100 >= min_keys ancestor keys: split).
SPLIT_BIG_SEGMENTS = [(1100, -1), (40, 0), (20, 0)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B head shape runs compiled, on CUDA")
def test_27b_split_alone_equals_packed_at_every_capacity_and_within_bound(gen: torch.Generator) -> None:
    """The shipped split config compiled: each segment's bits alone equal its bits packed, for a
    capacity that runs every block's splits in parallel (16), one that folds 3 of the 5 packed
    blocks in one program (2) and one that folds all (0) - and all three are the same bits; the
    root keeps the bits of split=False; the questions stay within the bf16 bound of the reference."""
    segments = SPLIT_BIG_SEGMENTS
    shipped = split_config(BIG_HD)
    assert shipped is not None
    configs = {cap: dataclasses.replace(shipped, capacity=cap) for cap in (16, 2, 0)}
    run, base = _big_case(segments, "bf16", gen)

    packed = {cap: run([2, 0, 1], pad=8, split=cfg)[0] for cap, cfg in configs.items()}
    walked, row_of = run([2, 0, 1], pad=8, split=False)
    want, _ = run([2, 0, 1], pad=8, backend="torch")
    assert torch.equal(packed[2], packed[16]) and torch.equal(packed[0], packed[16])
    for s, (n, _) in enumerate(segments):
        rows = slice(row_of[s], row_of[s] + n)
        for cap, cfg in configs.items():
            alone, _ = run([s], pad=0, split=cfg)
            assert torch.equal(alone[:n], packed[cap][rows]), (s, cap)
        if s == 0:
            assert torch.equal(packed[16][rows], walked[rows])  # no long ancestors: not split
    unit = 2.0**-8
    bound = 2 * unit * (1 + unit) * float(base.abs().max())
    err = (packed[16] - want).abs().max()
    assert err <= bound + 1e-5, f"split: {err:.3g} over {bound:.3g}"


# The length tiers, q16 and the short-ancestor split rule at their real size: a 1,100-token root
# (the tiered form's 128-row tier), a 300-token child of it (the 64-row tier, over 1,100 ancestor
# keys) and a 40-token question after the root (split by the shipped rule and the short one).
TIER_BIG_SEGMENTS = [(1100, -1), (40, 0), (300, 0)]
SHORT_SPLIT = SplitConfig(
    splits=11, min_keys=128, capacity=16, block_l=16, num_warps=8, num_stages=2, min_tiles=4
)
BIG_VARIANTS: dict[str, dict] = {
    "tiered": dict(long=long_configs(BIG_HD, "bf16", "tiered"), split=False),
    "q16": dict(long=dataclasses.replace(long_config(BIG_HD), q16=True), split=False),
    "short_split": dict(long=True, split=SHORT_SPLIT),
    "tiered_short_split": dict(long=long_configs(BIG_HD, "bf16", "tiered"), split=SHORT_SPLIT),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B head shape runs compiled, on CUDA")
@pytest.mark.parametrize("variant", sorted(BIG_VARIANTS))
def test_27b_tiers_q16_and_short_split_alone_equal_packed_and_within_bound(
    variant: str, gen: torch.Generator
) -> None:
    """Compiled at the 27B heads: each segment's bits alone equal its bits packed (for the split
    also at a capacity that folds blocks in one program), the output stays within the bf16 bound
    of the reference, and q16 gives the bits of the same config without it."""
    kw = BIG_VARIANTS[variant]
    run, base = _big_case(TIER_BIG_SEGMENTS, "bf16", gen)
    packed, row_of = run([2, 0, 1], pad=8, **kw)
    want, _ = run([2, 0, 1], pad=8, backend="torch")
    for s, (n, _) in enumerate(TIER_BIG_SEGMENTS):
        alone, _ = run([s], pad=0, **kw)
        assert torch.equal(alone[:n], packed[row_of[s] : row_of[s] + n]), s
    if isinstance(kw["split"], SplitConfig):
        folded = dataclasses.replace(kw["split"], capacity=1)
        assert torch.equal(run([2, 0, 1], pad=8, long=kw["long"], split=folded)[0], packed)
    if variant == "q16":
        assert torch.equal(run([2, 0, 1], pad=8, long=long_config(BIG_HD), split=False)[0], packed)
    unit = 2.0**-8
    bound = 2 * unit * (1 + unit) * float(base.abs().max())
    err = (packed - want).abs().max()
    assert err <= bound + 1e-5, f"{variant}: {err:.3g} over {bound:.3g}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B head shape runs compiled, on CUDA")
@pytest.mark.parametrize("variant", ["tiered", "q16", "tiered_short_split"])
def test_27b_bf16_queries_give_the_bits_of_fp32_ones(variant: str, gen: torch.Generator) -> None:
    """Compiled at the 27B heads (the shipped long tier stages its queries through q16): bf16
    queries, which skip that staging, give the fp32 queries' bits in every kernel."""
    kw = BIG_VARIANTS[variant]
    run, _ = _big_case(TIER_BIG_SEGMENTS, "bf16", gen)
    want, _ = run([2, 0, 1], pad=8, **kw)
    got, _ = run([2, 0, 1], pad=8, q_dtype=torch.bfloat16, **kw)
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B head shape runs compiled, on CUDA")
@pytest.mark.parametrize(("dots", "split"), [("ieee", False), ("bf16", False), ("bf16", True)])
def test_27b_aligned_loads_give_the_unhinted_bits(
    dots: str, split: bool, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PIECE_ALIGN only widens the fp32 K/V loads: the output is bit for bit the unhinted build's
    (every path reading pieces: the 16-row kernel, its split, the large-block ancestors, the
    shadow)."""
    run, _ = _big_case(SPLIT_BIG_SEGMENTS, dots, gen)
    monkeypatch.setattr(fa, "PIECE_ALIGN", 4)
    hinted, _ = run([2, 0, 1], pad=8, split=split)
    monkeypatch.setattr(fa, "PIECE_ALIGN", 1)
    plain, _ = run([2, 0, 1], pad=8, split=split)
    assert torch.equal(hinted, plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams and graphs are CUDA's")
@pytest.mark.parametrize("segments", ["split", "tiers"])
def test_27b_tiers_beside_the_16_row_kernel_give_the_serial_bits(
    segments: str, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`CONCURRENT_TIERS` runs the large-block tiers (and the bf16 shadow) on a side stream beside
    the split and the 16-row kernel: eager and replayed from a CUDA graph (the two branches of
    one capture, replayed twice over other inputs), the output is bit for bit the one-stream
    output, for a forest with a split question and one with both tiers."""
    chosen = SPLIT_BIG_SEGMENTS if segments == "split" else TIER_BIG_SEGMENTS
    run, _ = _big_case(chosen, "bf16", gen)
    monkeypatch.setattr(fa, "CONCURRENT_TIERS", False)
    serial, _ = run([2, 0, 1], pad=8)
    monkeypatch.setattr(fa, "CONCURRENT_TIERS", True)
    beside, _ = run([2, 0, 1], pad=8)
    torch.cuda.synchronize()
    assert torch.equal(beside, serial)

    # captured: fixed inputs in place, the graph's output read after each replay
    rows, segs, pieces, qblocks, _ = _big_tables(
        [2, 0, 1], _big_kv(chosen)[0], torch.device("cuda"), 8, chosen
    )
    t = rows.shape[0]
    base = torch.zeros(_big_kv(chosen)[1], device="cuda")
    q = torch.zeros(t, BIG_NH, BIG_HD, device="cuda")
    qg = torch.zeros(t, BIG_NH * 2 * BIG_HD, device="cuda")

    def call() -> torch.Tensor:
        return forest_attention(q, qg, base, rows, segs, pieces, qblocks, num_kv_heads=BIG_NKV, dots="bf16")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(2):
        base.copy_(torch.randn(base.shape[0], generator=gen).bfloat16().float().to("cuda"))
        q.copy_(torch.randn(q.shape, generator=gen).to("cuda"))
        qg.copy_(torch.randn(qg.shape, generator=gen).to("cuda"))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setattr(fa, "CONCURRENT_TIERS", False)
        assert torch.equal(out, call())
        monkeypatch.setattr(fa, "CONCURRENT_TIERS", True)


def _big_kv(segments: list[tuple[int, int]]) -> tuple[list[list[int]], int]:
    """Own piece records of `segments` laid back to back in one base, and its size."""
    block = BIG_NKV * BIG_HD
    kv, off = [], 0
    for n, _ in segments:
        kv.append([off, off + n * block, n, n])
        off += 2 * n * block
    return kv, off


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B head shape runs compiled, on CUDA")
def test_27b_keys_and_queries_parts_give_the_whole_preps_bits(gen: torch.Generator) -> None:
    """The body's last layer at 27B heads: the keys-only build (NH = 0) stores the whole prep's
    bits, the queries-only launch over the read rows makes their queries' bits."""
    dev = torch.device("cuda")
    kv, size = _big_kv(BIG_SEGMENTS)
    rows, segs, pieces, _, row_of = _big_tables([2, 0, 1], kv, dev, 8)
    t = rows.shape[0]
    heads = AttentionHeads(BIG_NH, BIG_NKV, BIG_HD, 1e-6)
    qg = torch.randn(t, BIG_NH * 2 * BIG_HD, generator=gen).to(dev)
    k, v = (torch.randn(t, BIG_NKV * BIG_HD, generator=gen).to(dev) for _ in range(2))
    rope = torch.randn(t, 2, 64, generator=gen).to(dev)
    x = PrepInputs(
        qg, k, v, 1 + 0.1 * torch.randn(BIG_HD, generator=gen).to(dev), torch.ones(BIG_HD, device=dev), rope
    )
    base = torch.zeros(size, device=dev)
    q_all = forest_attention_prep(x, base, rows, segs, pieces, heads)
    stored = base.clone()
    base.zero_()
    forest_attention_prep(x, base, rows, segs, pieces, heads, part="keys")
    assert torch.equal(base, stored)
    base.zero_()
    reads = torch.tensor([r + n - 1 for s, r in row_of.items() for n in [BIG_SEGMENTS[s][0]]], device=dev)
    at = PrepInputs(qg[reads], k[:1], v[:1], x.q_norm, x.k_norm, rope[reads])
    q = forest_attention_prep(at, base, rows[reads], segs, pieces, heads, part="queries")
    assert torch.equal(q, q_all[reads])
    assert not base.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B head shape runs compiled, on CUDA")
@pytest.mark.parametrize("splits", [1, DECODE_SPLITS])
def test_27b_read_rows_in_the_decode_kernel_alone_equal_packed_and_within_bound(
    splits: int, gen: torch.Generator
) -> None:
    """The read rows' attention as the body's last layer runs it at 27B heads (bf16 dots, the
    forest kernel's warps): each row's bits alone equal its bits among the others, and every row
    within the bf16 bound of the torch reference (bf16-representable q and K/V: only the
    weights are rounded)."""
    dev = torch.device("cuda")
    kv, size = _big_kv(BIG_SEGMENTS)
    rows, segs, pieces, qblocks, row_of = _big_tables([2, 0, 1], kv, dev, 8)
    t = rows.shape[0]
    base = torch.randn(size, generator=gen).bfloat16().float().to(dev)
    q = torch.randn(t, BIG_NH, BIG_HD, generator=gen).bfloat16().float().to(dev)
    qg = torch.randn(t, BIG_NH * 2 * BIG_HD, generator=gen).to(dev)
    want = forest_attention(q, qg, base, rows, segs, pieces, qblocks, num_kv_heads=BIG_NKV, backend="torch")
    reads = [r + BIG_SEGMENTS[s][0] - 1 for s, r in row_of.items()] + [row_of[0] + 150]
    drows = torch.zeros(len(reads), DECODE_ROW_FIELDS, dtype=torch.int64)
    dpieces = torch.zeros(len(reads), 2, 4, dtype=torch.int64)
    for j, r in enumerate(reads):
        drows[j, THOUGHT_LEN], drows[j, LIVE] = rows[r, 1].item(), 1
        dpieces[j] = pieces[rows[r, 0].item()].cpu()
    drows, dpieces = drows.to(dev), dpieces.to(dev)
    idx = torch.tensor(reads, device=dev)

    def attend(sel: slice) -> torch.Tensor:
        return decode_attention(
            q[idx[sel]], qg[idx[sel]], base, drows[sel], dpieces[sel], num_kv_heads=BIG_NKV, splits=splits,
            dots="bf16", num_warps=attention_warps(BIG_HD),
        )  # fmt: skip

    packed = attend(slice(None))
    for j in range(len(reads)):
        assert torch.equal(attend(slice(j, j + 1))[0], packed[j]), j
    unit = 2.0**-8
    bound = 2 * unit * (1 + unit) * float(base.abs().max())
    err = (packed - want[idx]).abs().max()
    assert err <= bound + 1e-5, f"splits {splits}: {err:.3g} over {bound:.3g}"


# ------------------------------------------------------------------ the FMHA tier (own blocks)
def _plan_oracle(segs: torch.Tensor, long_min: int) -> list[list[int]]:
    """The work list by hand: every live segment of at least long_min tokens, in slot order, its
    128-row tiles last first, as (tile, first row, length, 0)."""
    want = []
    for tok_lo, length, *rest in segs.tolist():
        if rest[SEG_LIVE - 2] and length >= long_min:
            n = -(-length // fa.FMHA_TILE)
            want += [[m, tok_lo, length, 0] for m in reversed(range(n))]
    return want


def test_fmha_plan_lists_the_long_segments_tiles_last_first(dev: torch.device) -> None:
    """The plan kernel against its hand-made list: long live segments only (a dead long slot and
    a short one skipped), a segment of exactly one tile, one a row past a tile, one of many
    chunks; the count, and a capacity that holds the worst case."""
    lengths = [(0, 1000, 1), (1000, 1024, 1), (2024, 300, 1), (2324, 5000, 0), (2324, 1153, 1),
               (3477, 128 * 70 + 5, 1)]  # fmt: skip
    segs = torch.tensor([_seg_record(*r) for r in lengths], dtype=torch.int64, device=dev)
    t = 3477 + 128 * 70 + 5
    tiles, count = fa.fmha_plan(segs, t, 1024)
    want = _plan_oracle(segs.cpu(), 1024)
    assert int(count[0]) == len(want)
    assert tiles[: len(want)].tolist() == want
    assert tiles.shape[0] == fa.fmha_capacity(t, 1024) >= len(want)


def test_fmha_capacity_holds_every_forest() -> None:
    """The list's capacity against forests of T rows built to need many tiles: as many long
    segments as fit, each a row past a whole number of tiles (every one with a one-row tail tile),
    one segment of all the rows, and random splits of T into long segments and a short rest."""
    rng = random.Random(5)
    for long_min in (128, 1000, 1024):
        for t in (long_min, 1500, 4096, 8192, 8192 + 7):
            forests = [[t]]
            step = -(-(long_min - 1) // fa.FMHA_TILE) * fa.FMHA_TILE + 1  # >= long_min, tail of one row
            forests.append([step] * (t // step))
            for _ in range(50):
                lengths, left = [], t
                while left >= long_min:
                    n = rng.randint(long_min, left)
                    lengths.append(n)
                    left -= n
                forests.append(lengths)
            for lengths in forests:
                need = sum(-(-n // fa.FMHA_TILE) for n in lengths)
                assert need <= fa.fmha_capacity(t, long_min), (t, long_min, lengths)


def _fmha_on_tiny_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch stand-in of the FMHA kernel takes any head size: let the tiny heads use it."""
    monkeypatch.setattr(fa, "FMHA_HEAD_DIM", HD)


def test_fmha_tier_moves_only_its_segments_and_stays_within_the_bf16_bound(
    dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last tier's own blocks through the FMHA path (interpreter: `forest_fmha_reference`
    stands in for the CUTLASS kernel; the fold, the ancestors and the gate are the Triton
    kernel's): the 70-token segment of "tiers" changes and stays within the bf16 oracle's bound,
    every other segment keeps the bits it had without the FMHA path, padding rows stay zero."""
    if dev.type == "cuda":
        pytest.skip("on CUDA the FMHA tier needs head_dim 256 (the 27B test below)")
    _fmha_on_tiny_heads(monkeypatch)
    case = _case(dev, gen)
    lay = _launch(case, list(range(len(SEGMENTS))), dev, spread=True)
    q = _prep(case, lay, "torch")
    tiers = LONG["tiers"]
    plain = forest_attention(
        q, lay.inputs()[0], case.pool.base, lay.rows, lay.segs, lay.pieces, lay.qblocks, num_kv_heads=NKV,
        dots="bf16", long=tiers, split=False, fmha=False,
    )  # fmt: skip
    fmha = forest_attention(
        q, lay.inputs()[0], case.pool.base, lay.rows, lay.segs, lay.pieces, lay.qblocks, num_kv_heads=NKV,
        dots="bf16", long=tiers, split=False, fmha=True,
    )  # fmt: skip
    want, bound = _oracle(case, lay, q, **TENSOR_CORE_ORACLE["bf16"])
    covered = torch.zeros(q.shape[0], dtype=torch.bool, device=dev)
    for s, row0 in lay.row_of.items():
        rows = slice(row0, row0 + SEGMENTS[s][1])
        covered[rows] = True
        if SEGMENTS[s][1] >= tiers[-1].min_length:
            assert not torch.equal(fmha[rows], plain[rows]), s  # the FMHA path ran
        else:
            assert torch.equal(fmha[rows], plain[rows]), s
    err = (fmha - want).abs()
    assert (err <= bound + 1e-5).all(), f"error {err.max():.3g} over its bound"
    assert torch.equal(fmha[~covered], torch.zeros_like(fmha[~covered]))


def test_fmha_tier_segment_bits_do_not_depend_on_the_launch(
    dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment's bits alone equal its bits in the spread launch with the FMHA path on."""
    if dev.type == "cuda":
        pytest.skip("on CUDA the FMHA tier needs head_dim 256 (the 27B test below)")
    _fmha_on_tiny_heads(monkeypatch)
    case = _case(dev, gen)
    members = list(range(len(SEGMENTS)))
    big = _launch(case, members, dev, spread=True)
    q_big = _prep(case, big, "triton")

    def attend(lay: Launch, q: torch.Tensor) -> torch.Tensor:
        return forest_attention(
            q, lay.inputs()[0], case.pool.base, lay.rows, lay.segs, lay.pieces, lay.qblocks, num_kv_heads=NKV,
            dots="bf16", long=LONG["tiers"], split=False, fmha=True,
        )  # fmt: skip

    out_big = attend(big, q_big)
    for s in members:
        alone = _launch(case, [s], dev, spread=False)
        out = attend(alone, _prep(case, alone, "triton"))
        assert torch.equal(out, out_big[big.row_of[s] : big.row_of[s] + SEGMENTS[s][1]]), s


def test_fmha_queries_are_read_in_place_only_with_their_padding(dev: torch.device) -> None:
    """`_fmha_queries` reads a prep's padded bf16 queries where they lie, and copies (rounded to
    nearest even) queries without the padding rows or in fp32."""
    q = torch.randn(5 + fa.FMHA_PAD, 2, 4, device=dev).to(torch.bfloat16)[:5]
    assert fa._fmha_queries(q, torch.bfloat16).data_ptr() == q.data_ptr()
    short = q.clone()
    copied = fa._fmha_queries(short, torch.bfloat16)
    assert copied.shape == (5 + fa.FMHA_PAD, 2, 4) and torch.equal(copied[:5], short)
    wide = torch.randn(5, 2, 4, device=dev)
    assert torch.equal(fa._fmha_queries(wide, torch.float32)[:5], wide.bfloat16().float())
    roomy = torch.randn(5 + fa.FMHA_PAD, 2, 4, device=dev)[:5]  # fp32 with room: still rounded
    assert torch.equal(fa._fmha_queries(roomy, torch.float32)[:5], roomy.bfloat16().float())


def test_fmha_padding_is_the_kernels_tile() -> None:
    """The rows the Python side plans in (`FMHA_TILE`) and pads Q and K/V with (`FMHA_PAD`) are the
    CUDA kernel's query tile, and its head size the kernel's (`kTileRows`, `TileShape`, `kHeadDim`
    in `cuda/forest_fmha_sm90.cuh`): a tail tile reads up to a tile less one row past a segment,
    so fewer padding rows would let it read past the buffers. The header is read as text because
    CI builds no CUDA."""
    import re
    from pathlib import Path

    from engine.kernels import cutlass_gemm

    text = (Path(fa.__file__).parent / "cuda" / "forest_fmha_sm90.cuh").read_text()
    tile = re.search(r"constexpr int kTileRows = (\d+);", text)
    head = re.search(r"constexpr int kHeadDim = (\d+);", text)
    shape = re.search(r"using TileShape = Shape<_(\d+),", text)
    assert tile is not None and head is not None and shape is not None
    assert (
        int(tile.group(1))
        == int(shape.group(1))
        == cutlass_gemm.FMHA_TILE_ROWS
        == fa.FMHA_PAD
        == fa.FMHA_TILE
    )
    assert int(head.group(1)) == cutlass_gemm.FMHA_HEAD_DIM == fa.FMHA_HEAD_DIM


def test_fmha_tier_refuses_a_library_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA without the library's FMHA unit the setting True raises instead of silently giving
    the Triton tier's (other) bits; off, or at another head size or dot format, it does not apply."""
    from engine.kernels import cutlass_gemm

    monkeypatch.setattr(cutlass_gemm, "library", lambda: None)
    tiers = long_configs(256, "bf16")
    cuda = torch.device("cuda")
    with pytest.raises(RuntimeError, match="FMHA_LONG_TIER needs the CUTLASS library"):
        fa._fmha_tier(tiers, 256, "bf16", True, cuda)
    assert fa._fmha_tier(tiers, 256, "bf16", False, cuda) is None
    # the default (None): the kernel where the library has it, else the Triton tier, and the
    # Triton tier under the interpreter
    monkeypatch.setattr(fa, "FMHA_LONG_TIER", None)
    assert fa._fmha_tier(tiers, 256, "bf16", None, cuda) is None
    assert fa._fmha_tier(tiers, 256, "bf16", None, torch.device("cpu")) is None

    class WithUnit:
        has_forest_fmha = True

    monkeypatch.setattr(cutlass_gemm, "library", lambda: WithUnit())
    assert fa._fmha_tier(tiers, 256, "bf16", None, cuda) is tiers[-1]
    assert fa._fmha_tier(tiers, 256, "bf16", False, cuda) is None
    monkeypatch.setattr(cutlass_gemm, "library", lambda: None)
    assert fa._fmha_tier(tiers, 128, "bf16", True, cuda) is None
    assert fa._fmha_tier(tiers, 256, "tf32", True, cuda) is None
    assert fa._fmha_tier(tiers, 256, "bf16", True, torch.device("cpu")) is tiers[-1]


# The FMHA kernel alone at its real size: segments of odd lengths (a tail tile of one row, one of
# 127), several tiles, the 27B's 24 query heads over 4 KV heads in one launch.
FMHA_SEGMENTS = [1025, 3000, 1151]


def _fmha_inputs(lengths: list[int], gen: torch.Generator, pad: int) -> tuple[torch.Tensor, ...]:
    dev = torch.device("cuda")
    t = sum(lengths) + pad * (len(lengths) + 1)
    q = torch.randn(t + fa.FMHA_PAD, BIG_NH, BIG_HD, generator=gen).bfloat16().to(dev)
    kv = torch.randn(2, t + fa.FMHA_PAD, BIG_NKV, BIG_HD, generator=gen).bfloat16().to(dev)
    segs, row = [], pad
    for n in lengths:
        segs.append(_seg_record(row, n, 1))
        row += n + pad
    return q, kv[0], kv[1], torch.tensor(segs, dtype=torch.int64, device=dev), torch.tensor(t)


def _fmha_library() -> Any:
    """The CUTLASS library with its FMHA unit, or skip."""
    from engine.kernels import cutlass_gemm

    lib = cutlass_gemm.library()
    if lib is None or not lib.has_forest_fmha:
        pytest.skip("needs the CUTLASS library with its FMHA unit (make cutlass) on an sm_90 GPU")
    return lib


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUTLASS FMHA kernel runs on sm_90")
def test_27b_fmha_kernel_matches_its_reference_and_writes_only_listed_rows(gen: torch.Generator) -> None:
    """`Library.forest_fmha` against `forest_fmha_reference` (fp32 softmax over the same bf16
    values): the output within the bf16 rounding of the probabilities (2u(1 + u) max |v|), the
    LSE within a few fp32 ulps of its size; rows outside the listed segments keep their sentinel."""
    lib = _fmha_library()
    q, k, v, segs, t_ = _fmha_inputs(FMHA_SEGMENTS, gen, pad=8)
    t = int(t_)
    tiles, count = fa.fmha_plan(segs, t, 1024)
    out = torch.full((t, BIG_NH * BIG_HD), 7.0, device="cuda")
    lse = torch.full((t, BIG_NH), 7.0, device="cuda")
    lib.forest_fmha(q, k, v, out, lse, tiles, count, t)
    want, want_lse = out.clone().fill_(7.0), lse.clone().fill_(7.0)
    fa.forest_fmha_reference(q, k, v, want, want_lse, tiles, count)
    torch.cuda.synchronize()
    listed = want_lse[:, 0] != 7.0
    assert torch.equal(out[~listed], want[~listed]) and torch.equal(lse[~listed], want_lse[~listed])
    unit = 2.0**-8
    bound = 2 * unit * (1 + unit) * float(v.float().abs().max())
    err = (out[listed] - want[listed]).abs().max()
    assert err <= bound, f"output {err:.3g} over {bound:.3g}"
    torch.testing.assert_close(lse[listed], want_lse[listed], rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUTLASS FMHA kernel runs on sm_90")
def test_27b_fmha_kernel_segment_bits_do_not_depend_on_the_launch(gen: torch.Generator) -> None:
    """A segment's output and LSE alone (its rows first, nothing after) equal its bits in the
    packed call (other segments before and after it, other rows), bit for bit."""
    lib = _fmha_library()
    q, k, v, segs, t_ = _fmha_inputs(FMHA_SEGMENTS, gen, pad=8)
    t = int(t_)
    tiles, count = fa.fmha_plan(segs, t, 1024)
    out = torch.zeros(t, BIG_NH * BIG_HD, device="cuda")
    lse = torch.zeros(t, BIG_NH, device="cuda")
    lib.forest_fmha(q, k, v, out, lse, tiles, count, t)
    for s, n in enumerate(FMHA_SEGMENTS):
        row = int(segs[s, 0])
        q1 = torch.zeros(n + fa.FMHA_PAD, BIG_NH, BIG_HD, dtype=torch.bfloat16, device="cuda")
        q1[:n] = q[row : row + n]
        k1 = torch.zeros(n + fa.FMHA_PAD, BIG_NKV, BIG_HD, dtype=torch.bfloat16, device="cuda")
        v1 = torch.zeros_like(k1)
        k1[:n], v1[:n] = k[row : row + n], v[row : row + n]
        one = torch.tensor([_seg_record(0, n, 1)], dtype=torch.int64, device="cuda")
        tiles1, count1 = fa.fmha_plan(one, n, 1024)
        out1 = torch.zeros(n, BIG_NH * BIG_HD, device="cuda")
        lse1 = torch.zeros(n, BIG_NH, device="cuda")
        lib.forest_fmha(q1, k1, v1, out1, lse1, tiles1, count1, n)
        assert torch.equal(out1, out[row : row + n]), s
        assert torch.equal(lse1, lse[row : row + n]), s


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 27B head shape runs compiled, on CUDA")
def test_27b_fmha_tier_alone_equals_packed_and_within_bound(gen: torch.Generator) -> None:
    """The FMHA tier in forest_attention at the 27B heads (the 1,100-token root in it, a 300-token
    child and a 40-token question outside it): each segment's bits alone equal its bits packed,
    the segments outside the tier keep the Triton path's bits, the output stays within the bf16
    bound of the reference."""
    _fmha_library()
    run, base = _big_case(TIER_BIG_SEGMENTS, "bf16", gen)
    packed, row_of = run([2, 0, 1], pad=8, fmha=True)
    plain, _ = run([2, 0, 1], pad=8, fmha=False)
    want, _ = run([2, 0, 1], pad=8, backend="torch")
    for s, (n, _) in enumerate(TIER_BIG_SEGMENTS):
        rows = slice(row_of[s], row_of[s] + n)
        alone, _ = run([s], pad=0, fmha=True)
        assert torch.equal(alone[:n], packed[rows]), s
        assert torch.equal(packed[rows], plain[rows]) == (n < fa.TIER_LENGTH), s
    unit = 2.0**-8
    bound = 2 * unit * (1 + unit) * float(base.abs().max())
    err = (packed - want).abs().max()
    assert err <= bound + 1e-5, f"fmha: {err:.3g} over {bound:.3g}"
