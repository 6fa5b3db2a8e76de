"""Forest conv + Gated DeltaNet kernels over a packed 3-level forest: against their torch references,
against an oracle that runs each root-to-segment chain as one sequence, level by level, segment
by segment (a segment's bits alone equal its bits among others), and against the decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import forest_gdn as forest_gdn_module
from engine.kernels.decode_gdn import conv_step, gdn_step
from engine.kernels.decode_rows import CONV_OFF, LIVE, STATE_OFF
from engine.kernels.decode_rows import ROW_FIELDS as DECODE_ROW_FIELDS
from engine.kernels.forest_gdn import (
    TC_CHUNK,
    TC_DECAYED_FORMS,
    TC_PREP_FORMS,
    forest_conv,
    forest_conv_reference,
    forest_gdn,
    forest_gdn_outputs,
    forest_gdn_prep,
    forest_gdn_reference,
    invert_compiles_for,
)
from engine.kernels.forest_tables import (
    CONV_ROW,
    CONV_TAIL,
    CONV_ZERO,
    ROW_FIELDS,
    ROW_LIVE,
    ROW_LOCAL,
    SEG_CONV_OUT,
    SEG_FIELDS,
    SEG_HAS_STATE_IN,
    SEG_LENGTH,
    SEG_LEVEL,
    SEG_LIVE,
    SEG_STATE_IN,
    SEG_STATE_OUT,
    SEG_TOK_LO,
)
from engine.run.reference import causal_conv, gated_delta_rule, l2_normalize
from tests.engine.kernels.pool import Pool

HQK, HV, DK, DV = 2, 4, 16, 16
C = 2 * HQK * DK + HV * DV
N_GDN, LAYER = 2, 1  # blocks hold two GDN layers; the tests run layer 1 (nonzero layer_off)
STATE = HV * DK * DV
KW = dict(num_k_heads=HQK, num_v_heads=HV, k_dim=DK, v_dim=DV)
# one alpha input is 100 on purpose: exp overflows in softplus' branch that the threshold discards
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# slot -> (parent slot or None, length); roots start from a stored state and tail or from zeros
NODES: dict[int, tuple[int | None, int]] = {
    0: (None, 5),  # stored start: CONV_TAIL sources, has_state_in
    1: (None, 2),  # zero start
    2: (0, 1),
    3: (0, 9),
    4: (2, 2),  # sources span the grandparent's and the parent's rows
    5: (1, 0),  # an empty live child: its tail is its sources, its state its parent's
    6: (5, 1),  # child of the empty segment: sources (zero, row, row)
    8: (None, 1),  # stored start, shorter than W - 1
    9: (8, 2),  # sources mix the stored tail and the parent's row
}
STORED = (0, 8)
PAD_SLOT = 7
S = 10
ORDER = [3, None, 0, 9, 1, None, 4, 2, 5, 6, None, 8]  # packing order; None: a padding row


def _chain(s: int) -> list[int]:
    """Slots from the root down to s."""
    parent = NODES[s][0]
    return [s] if parent is None else [*_chain(parent), s]


def _level(s: int) -> int:
    return len(_chain(s)) - 1


@dataclass
class Case:
    w: int
    pool: Pool
    before: torch.Tensor  # the pool's initial contents (each run starts from them)
    x: torch.Tensor  # [T, C] column slice of a wider tensor (row stride > C)
    weight: torch.Tensor
    b_raw: torch.Tensor  # [T, HV] column slices of one [T, 2 * HV] tensor
    a_raw: torch.Tensor
    ssm_a: torch.Tensor
    dt: torch.Tensor
    rows: torch.Tensor
    segs: torch.Tensor
    conv_src: torch.Tensor
    first_row: dict[int, int]  # slot -> its first packed row
    stored: dict[int, tuple[int, int]]  # stored root slot -> (state block, tail block)

    @property
    def tail(self) -> int:
        return C * (self.w - 1)

    @property
    def conv_off(self) -> int:
        return LAYER * self.tail

    def seg_rows(self, s: int) -> list[int]:
        return list(range(self.first_row[s], self.first_row[s] + NODES[s][1]))


def _case(dev: torch.device, gen: torch.Generator, w: int = 4, dtype: torch.dtype = torch.float32) -> Case:
    tail = C * (w - 1)
    pool = Pool((len(NODES) + len(STORED)) * N_GDN * (STATE + tail) + 64, dev, gen)
    pool.base.mul_(0.3)
    stored = {s: (pool.take(N_GDN * STATE), pool.take(N_GDN * tail)) for s in STORED}
    out_blocks = {s: (pool.take(N_GDN * STATE), pool.take(N_GDN * tail)) for s in NODES}
    first_row: dict[int, int] = {}
    rows: list[list[int]] = []
    for s in ORDER:
        if s is None:
            rows.append([1000, 99, 0, 0])  # padding row: garbage slot and local index
        else:
            first_row[s] = len(rows)
            rows += [[s, i, 1, 0] for i in range(NODES[s][1])]
    t = len(rows)
    # what precedes each segment's first token, oldest first: stored tail slots, zeros, ancestors' rows
    before: dict[int, list[list[int]]] = {}
    for s in sorted(NODES, key=_level):  # parents first
        parent, _ = NODES[s]
        if parent is None:
            start = stored[s][1] if s in STORED else None
            before[s] = [
                [CONV_TAIL, start + k] if start is not None else [CONV_ZERO, 0] for k in range(w - 1)
            ]
        else:
            p_rows = range(first_row[parent], first_row[parent] + NODES[parent][1])
            before[s] = (before[parent] + [[CONV_ROW, r] for r in p_rows])[-(w - 1) :]
    segs = torch.zeros(S, SEG_FIELDS, dtype=torch.int64)
    conv_src = torch.zeros(S, w - 1, 2, dtype=torch.int64)
    garbage_state, garbage_tail = stored[0]  # never read (has_state_in 0) or never written (padding)
    for s, (parent, n) in NODES.items():
        rec = segs[s]
        rec[SEG_TOK_LO], rec[SEG_LENGTH], rec[SEG_LIVE] = first_row[s], n, 1
        rec[SEG_STATE_OUT], rec[SEG_CONV_OUT] = out_blocks[s]
        if parent is not None:
            rec[SEG_STATE_IN], rec[SEG_HAS_STATE_IN] = out_blocks[parent][0], 1
        elif s in STORED:
            rec[SEG_STATE_IN], rec[SEG_HAS_STATE_IN] = stored[s][0], 1
        else:
            rec[SEG_STATE_IN] = garbage_state
        conv_src[s] = torch.tensor(before[s])
    segs[PAD_SLOT] = torch.tensor([0, 3, 0, garbage_state, 1, garbage_state, garbage_tail, 0])
    conv_src[PAD_SLOT, :, 0] = CONV_TAIL
    conv_src[PAD_SLOT, :, 1] = garbage_tail
    for s in NODES:
        segs[s, SEG_LEVEL] = _level(s)
    wide = torch.randn(t, C + 8, generator=gen).to(dtype)
    ba = torch.randn(t, 2 * HV, generator=gen) * 2
    ba[first_row[3], HV] = 25.0  # past softplus' threshold
    ba[first_row[0] + 2, HV + 1] = 100.0  # exp overflows without the threshold (ssm_a[1] is small)
    return Case(
        w=w,
        pool=pool,
        before=pool.base.clone(),
        x=wide.to(dev)[:, 3 : 3 + C],
        weight=(torch.randn(C, w, generator=gen) * 0.5).to(dev),
        b_raw=ba.to(dev)[:, :HV],
        a_raw=ba.to(dev)[:, HV:],
        ssm_a=(-torch.rand(HV, generator=gen) * 2).index_fill(0, torch.tensor([1]), -0.05).to(dev),
        dt=torch.randn(HV, generator=gen).to(dev),
        rows=torch.tensor(rows, dtype=torch.int64).to(dev),
        segs=segs.to(dev),
        conv_src=conv_src.to(dev),
        first_row=first_row,
        stored=stored,
    )


def _run(case: Case, backend: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """The whole forest at layer LAYER from the initial pool: (y, o); o rows never written stay NaN."""
    case.pool.base.copy_(case.before)
    y = forest_conv(
        case.x, case.weight, case.pool.base, case.rows, case.segs, case.conv_src, case.conv_off,
        backend=backend,
    )  # fmt: skip
    out = torch.full((y.shape[0], HV, DV), float("nan"), device=y.device)
    for level in range(3):
        forest_gdn(
            y, case.b_raw, case.a_raw, case.ssm_a, case.dt, case.pool.base, case.segs, level,
            LAYER * STATE, out, **KW, backend=backend,
        )  # fmt: skip
    return y, out


def _state_out(case: Case, s: int) -> torch.Tensor:
    off = int(case.segs[s, SEG_STATE_OUT]) + LAYER * STATE
    return case.pool.base[off : off + STATE].view(HV, DK, DV)


def _tail_out(case: Case, s: int) -> torch.Tensor:
    off = int(case.segs[s, SEG_CONV_OUT]) + case.conv_off
    return case.pool.base[off : off + case.tail].view(C, case.w - 1)


def _oracle(case: Case, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segment s's (y, o, final state, final tail): its root-to-s chain run as one sequence."""
    chain = _chain(s)
    idx = [r for c in chain for r in case.seg_rows(c)]
    root = chain[0]
    dev = case.x.device
    if root in STORED:
        state_blk, tail_blk = case.stored[root]
        s0 = case.before[state_blk + LAYER * STATE :][:STATE].view(HV, DK, DV)
        tail0 = case.before[tail_blk + case.conv_off :][: case.tail].view(C, case.w - 1)
    else:
        s0 = torch.zeros(HV, DK, DV, device=dev)
        tail0 = torch.zeros(C, case.w - 1, device=dev)
    pre, tail = causal_conv(case.x[idx].float(), tail0, case.weight.float())
    y = F.silu(pre)
    q, k, v = torch.split(y, [HQK * DK, HQK * DK, HV * DV], dim=-1)
    n = len(idx)
    q = (l2_normalize(q.reshape(n, HQK, DK)) * DK**-0.5).repeat_interleave(HV // HQK, dim=1)
    k = l2_normalize(k.reshape(n, HQK, DK)).repeat_interleave(HV // HQK, dim=1)
    beta = torch.sigmoid(case.b_raw[idx].float())
    g = case.ssm_a * F.softplus(case.a_raw[idx].float() + case.dt)
    o, state = gated_delta_rule(q, k, v.reshape(n, HV, DV), g, beta, s0.clone())
    own = NODES[s][1]
    return y[n - own :], o[n - own :], state, tail


def _written(case: Case, *, conv: bool, state: bool) -> torch.Tensor:
    """Mask of the pool elements a forest pass may write (layer LAYER of the live out blocks)."""
    mask = torch.zeros(case.pool.base.numel(), dtype=torch.bool, device=case.pool.base.device)
    for s in NODES:
        if conv:
            off = int(case.segs[s, SEG_CONV_OUT]) + case.conv_off
            mask[off : off + case.tail] = True
        if state:
            off = int(case.segs[s, SEG_STATE_OUT]) + LAYER * STATE
            mask[off : off + STATE] = True
    return mask


@pytest.mark.parametrize(
    ("w", "dtype"), [(4, torch.float32), (4, torch.bfloat16), (2, torch.float32), (3, torch.float32)]
)
def test_conv_matches_reference_and_writes_only_the_tails(
    dev: torch.device, gen: torch.Generator, w: int, dtype: torch.dtype
) -> None:
    case = _case(dev, gen, w, dtype)
    y = forest_conv(
        case.x, case.weight, case.pool.base, case.rows, case.segs, case.conv_src, case.conv_off,
        backend="triton",
    )  # fmt: skip
    after = case.pool.base.clone()
    case.pool.base.copy_(case.before)
    y_ref = forest_conv_reference(
        case.x, case.weight, case.pool.base, case.rows, case.segs, case.conv_src, case.conv_off
    )
    # y agrees to rounding (the sum order matches, torch's sum and SiLU may round differently);
    # padding rows are zeros in both
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    pad = case.rows[:, ROW_LIVE] == 0
    assert pad.any() and torch.equal(y[pad], torch.zeros_like(y[pad]))
    assert torch.equal(after, case.pool.base)  # final tails are copies of inputs: exact
    keep = ~_written(case, conv=True, state=False)
    assert torch.equal(after[keep], case.before[keep])  # the padding slot wrote nothing
    for s in NODES:  # a tail is its segment's last W - 1 inputs, its sources filling in
        lo, n = case.first_row[s], NODES[s][1]
        own = case.x[lo : lo + n].float().T[:, max(0, n - (w - 1)) :]
        assert torch.equal(_tail_out(case, s)[:, w - 1 - own.shape[1] :], own), s


def test_forest_matches_each_chain_run_as_one_sequence(dev: torch.device, gen: torch.Generator) -> None:
    case = _case(dev, gen)
    y, out = _run(case)
    for s in NODES:
        rows = case.seg_rows(s)
        y_o, o_o, state_o, tail_o = _oracle(case, s)
        torch.testing.assert_close(y[rows], y_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[rows], o_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_state_out(case, s), state_o, rtol=1e-5, atol=1e-5)
        assert torch.equal(_tail_out(case, s), tail_o.float()), s
    pad = case.rows[:, ROW_LIVE] == 0
    assert out[pad].isnan().all()  # padding rows: no segment's o
    keep = ~_written(case, conv=True, state=True)
    assert torch.equal(case.pool.base[keep], case.before[keep])
    # the torch backend (segment-by-segment references) agrees
    y_t, out_t = _run(case, "torch")
    torch.testing.assert_close(y, y_t, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.isnan(), out_t.isnan())
    torch.testing.assert_close(out.nan_to_num(), out_t.nan_to_num(), rtol=1e-5, atol=1e-5)


def test_levels_chain_through_state_blocks(dev: torch.device, gen: torch.Generator) -> None:
    case = _case(dev, gen)
    base = case.pool.base
    y = forest_conv(case.x, case.weight, base, case.rows, case.segs, case.conv_src, case.conv_off)
    y_ref = y.clone()
    ref_base = base.clone()
    out = torch.full((y.shape[0], HV, DV), float("nan"), device=dev)
    out_ref = out.clone()
    done: set[int] = set()
    for level in range(3):
        prev = base.clone()
        forest_gdn(
            y, case.b_raw, case.a_raw, case.ssm_a, case.dt, base, case.segs, level, LAYER * STATE, out, **KW
        )
        forest_gdn_reference(
            y_ref, case.b_raw, case.a_raw, case.ssm_a, case.dt, ref_base, case.segs, level, LAYER * STATE,
            out_ref, HQK, HV, DK, DV,
        )  # fmt: skip
        torch.testing.assert_close(base, ref_base, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.nan_to_num(), out_ref.nan_to_num(), rtol=1e-5, atol=1e-5)
        members = [s for s in NODES if _level(s) == level]
        done.update(members)
        # this level's rows and final states are written, nothing of the other levels
        for s in NODES:
            if NODES[s][1]:
                assert out[case.seg_rows(s)].isnan().all() != (s in done), (level, s)
            off = int(case.segs[s, SEG_STATE_OUT]) + LAYER * STATE
            changed = not torch.equal(base[off : off + STATE], prev[off : off + STATE])
            assert changed == (s in members), (level, s)
        for s in members:  # children start from the state their parent left in the previous launch
            torch.testing.assert_close(_state_out(case, s), _oracle(case, s)[2], rtol=1e-5, atol=1e-5)
    # an empty child hands its parent's state on unchanged
    assert torch.equal(_state_out(case, 5), _state_out(case, 1))


def test_segment_alone_equals_segment_among_others(dev: torch.device, gen: torch.Generator) -> None:
    case = _case(dev, gen)
    y_all, out_all = _run(case)
    full = case.pool.base.clone()
    for s, (_, n) in NODES.items():
        lo = case.first_row[s]
        src = case.conv_src[s].clone()
        src_rows = [int(v) for kind, v in src.tolist() if kind == CONV_ROW]
        for i, (kind, v) in enumerate(src.tolist()):
            if kind == CONV_ROW:
                src[i, 1] = n + src_rows.index(v)
        idx = torch.tensor([*range(lo, lo + n), *src_rows], dtype=torch.int64, device=dev)
        rows = torch.zeros(idx.numel(), ROW_FIELDS, dtype=torch.int64)  # source rows: padding
        rows[:n, ROW_LOCAL] = torch.arange(n)
        rows[:n, ROW_LIVE] = 1
        segs = case.segs[s : s + 1].clone()
        segs[0, SEG_TOK_LO], segs[0, SEG_LEVEL] = 0, 0
        # start from the full pass's pool (the parent's final state is there) with the outputs spoiled
        case.pool.base.copy_(full)
        _state_out(case, s).fill_(7.0)
        _tail_out(case, s).fill_(7.0)
        src = src.unsqueeze(0).contiguous()
        y = forest_conv(case.x[idx], case.weight, case.pool.base, rows.to(dev), segs, src, case.conv_off)
        out = torch.zeros(y.shape[0], HV, DV, device=dev)
        b_raw, a_raw = case.b_raw[idx], case.a_raw[idx]
        forest_gdn(y, b_raw, a_raw, case.ssm_a, case.dt, case.pool.base, segs, 0, LAYER * STATE, out, **KW)
        assert torch.equal(y[:n], y_all[lo : lo + n]), s
        assert torch.equal(out[:n], out_all[lo : lo + n]), s
        assert torch.equal(case.pool.base, full), s  # final state and tail: the same bits


def test_forest_segment_continues_like_decode_steps(dev: torch.device, gen: torch.Generator) -> None:
    """A stored-start root prefilled by the forest kernels equals its tokens fed one by one to the
    decode step kernels (same fused math, same fp-fusion setting): bit for bit."""
    case = _case(dev, gen)
    y_all, out_all = _run(case)
    forest_state, forest_tail = _state_out(case, 0).clone(), _tail_out(case, 0).clone()
    case.pool.base.copy_(case.before)
    state_blk, tail_blk = case.stored[0]
    dec_rows = torch.zeros(1, DECODE_ROW_FIELDS, dtype=torch.int64)
    dec_rows[0, STATE_OFF], dec_rows[0, CONV_OFF], dec_rows[0, LIVE] = state_blk, tail_blk, 1
    dec_rows = dec_rows.to(dev)
    for r in case.seg_rows(0):
        y = conv_step(case.x[r : r + 1], case.weight, case.pool.base, dec_rows, case.conv_off)
        o = gdn_step(
            y, case.b_raw[r : r + 1], case.a_raw[r : r + 1], case.ssm_a, case.dt, case.pool.base, dec_rows,
            LAYER * STATE, **KW,
        )  # fmt: skip
        assert torch.equal(y[0], y_all[r]) and torch.equal(o[0], out_all[r]), r
    off = state_blk + LAYER * STATE
    assert torch.equal(case.pool.base[off : off + STATE].view(HV, DK, DV), forest_state)
    off = tail_blk + case.conv_off
    assert torch.equal(case.pool.base[off : off + case.tail].view(C, case.w - 1), forest_tail)


def test_bad_tables_are_named(gen: torch.Generator) -> None:
    cpu = torch.device("cpu")
    case = _case(cpu, gen)
    base = case.pool.base
    t = case.x.shape[0]

    def conv(**kw: object) -> None:
        args = dict(
            x=case.x, weight=case.weight, base=base, rows=case.rows, segs=case.segs,
            conv_src=case.conv_src, layer_off=case.conv_off,
        )  # fmt: skip
        args.update(kw)
        forest_conv(**args, backend="torch")  # type: ignore[arg-type]

    def gdn(**kw: object) -> None:
        y = torch.zeros(t, C)
        args = dict(
            conv=y, b_raw=case.b_raw, a_raw=case.a_raw, ssm_a=case.ssm_a, dt=case.dt, base=base,
            segs=case.segs, level=0, layer_off=LAYER * STATE, out=torch.zeros(t, HV, DV), **KW,
        )  # fmt: skip
        args.update(kw)
        forest_gdn(**args, backend="torch")  # type: ignore[arg-type]

    def edit(table: torch.Tensor, index: tuple[int, ...], value: int) -> torch.Tensor:
        table = table.clone()
        table[index] = value
        return table

    live_row = case.first_row[3]
    cases = [
        (conv, dict(rows=case.rows.int()), "rows must be contiguous int64"),
        (conv, dict(segs=case.segs[:, :7].contiguous()), "segs must be contiguous int64"),
        (conv, dict(weight=case.weight[:, :3]), "conv_src must be contiguous int64"),
        (conv, dict(weight=case.weight[:, :1]), r"W >= 2"),
        (conv, dict(base=base.double()), "base must be"),
        (conv, dict(conv_src=edit(case.conv_src, (0, 1, 0), 5)), "kind 5"),
        (conv, dict(conv_src=edit(case.conv_src, (3, 0, 1), t)), f"names row {t}"),
        (conv, dict(conv_src=edit(case.conv_src, (0, 0, 1), base.numel())), "tail block"),
        (conv, dict(rows=edit(case.rows, (live_row, 0), PAD_SLOT)), "not a live slot"),
        (conv, dict(rows=edit(case.rows, (live_row, 1), 4)), "local index 4"),
        (conv, dict(rows=edit(case.rows, (live_row, 2), 0)), "not all live"),
        (conv, dict(segs=edit(case.segs, (3, SEG_LENGTH), t + 1)), "do not fit"),
        (conv, dict(segs=edit(case.segs, (2, SEG_CONV_OUT), base.numel())), "conv_out block"),
        (gdn, dict(segs=edit(case.segs, (0, SEG_STATE_IN), base.numel())), "state_in block"),
        (gdn, dict(segs=edit(case.segs, (1, SEG_STATE_OUT), base.numel())), "state_out block"),
        (gdn, dict(conv=torch.zeros(t, C + 1)), "conv must be fp32"),
        (gdn, dict(out=torch.zeros(t, HV, DV + 1)), "out must be"),
        (gdn, dict(b_raw=case.b_raw[:, :2]), "b_raw must be"),
        (gdn, dict(num_k_heads=3, conv=torch.zeros(t, 2 * 3 * DK + HV * DV)), "multiple"),
        (gdn, dict(level=-1), "level"),
    ]
    for fn, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(**kw)
    # a table that is valid but for another level's segment is not checked at this level
    gdn(segs=edit(case.segs, (2, SEG_STATE_OUT), base.numel()))


def _long_forest(dev: torch.device, gen: torch.Generator, lengths: list[int], first_row: list[int], t: int):
    """A root of lengths[0] tokens from a stored state, its child of lengths[1] (level 1): tables,
    inputs, and the pool (its state blocks at known offsets)."""
    pool = Pool(4 * N_GDN * STATE + 64, dev, gen)
    pool.base.mul_(0.3)
    stored, out0, out1 = (pool.take(N_GDN * STATE) for _ in range(3))
    segs = torch.zeros(2, SEG_FIELDS, dtype=torch.int64)
    segs[:, SEG_LIVE] = 1
    segs[0, [SEG_TOK_LO, SEG_LENGTH, SEG_LEVEL, SEG_STATE_IN, SEG_HAS_STATE_IN, SEG_STATE_OUT]] = (
        torch.tensor([first_row[0], lengths[0], 0, stored, 1, out0])
    )
    segs[1, [SEG_TOK_LO, SEG_LENGTH, SEG_LEVEL, SEG_STATE_IN, SEG_HAS_STATE_IN, SEG_STATE_OUT]] = (
        torch.tensor([first_row[1], lengths[1], 1, out0, 1, out1])
    )
    conv = torch.randn(t, C, generator=gen).to(dev)
    ab = torch.randn(t, 2 * HV, generator=gen).to(dev)
    ssm_a = -torch.rand(HV, generator=gen).to(dev) - 0.1
    dt = torch.randn(HV, generator=gen).to(dev) * 0.1
    return pool, segs.to(dev), conv, ab[:, :HV], ab[:, HV:], ssm_a, dt, (out0, out1)


def _run_levels(
    pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk: int, backend: str = "triton", dots: str = "ieee",
    **tc,
) -> torch.Tensor:  # fmt: skip
    """Both levels; tc: walk= for the chunk-64 prep, outputs=False to make the outputs after the
    last level in one launch (as the body does)."""
    out = torch.zeros(conv.shape[0], HV, DV, device=conv.device)
    prep = None
    outputs = tc.pop("outputs", True)
    if chunk and backend == "triton":  # once for both levels, as the body does
        qb = _qblocks(segs)
        prep = forest_gdn_prep(conv, b_raw, a_raw, ssm_a, dt, segs, qb, **KW, chunk=chunk, dots=dots, **tc)
    for level in range(2):
        forest_gdn(
            conv, b_raw, a_raw, ssm_a, dt, pool.base, segs, level, LAYER * STATE, out, **KW,
            chunk=chunk, dots=dots, prep=prep, outputs=outputs, backend=backend,
        )  # fmt: skip
    if not outputs:
        forest_gdn_outputs(prep, segs, out)
    return out


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunked_recurrence_equals_the_token_by_token_one(
    chunk: int, dev: torch.device, gen: torch.Generator
) -> None:
    """Chunks of 16 or 32 over segments of 40 and 21 tokens (partial chunks, a child starting from its
    parent's final state): outputs and final states agree with the token-by-token kernel and the
    torch reference to fp32 rounding."""
    lengths, t = [40, 21], 64
    pool, segs, conv, b_raw, a_raw, ssm_a, dt, outs = _long_forest(dev, gen, lengths, [3, 43], t)
    before = pool.base.clone()
    got = _run_levels(pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk=chunk)
    got_states = [pool.base[o + LAYER * STATE :][:STATE].clone() for o in outs]
    pool.base.copy_(before)
    ref = _run_levels(pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk=0, backend="torch")
    ref_states = [pool.base[o + LAYER * STATE :][:STATE].clone() for o in outs]
    pool.base.copy_(before)
    step = _run_levels(pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk=0)
    rows = [*range(3, 43), *range(43, 64)]
    torch.testing.assert_close(got[rows], ref[rows], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[rows], step[rows], rtol=1e-4, atol=1e-5)
    for g, r in zip(got_states, ref_states, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    assert not got[rows].isnan().any()


@pytest.mark.parametrize("dots", ["ieee", "tf32"])
def test_chunked_segment_bits_do_not_depend_on_the_launch(
    dots: str, dev: torch.device, gen: torch.Generator
) -> None:
    """The child alone (its rows at 0, its parent's final state from the packed run as its
    start) gives the bits it has packed after its parent, at either dot precision."""
    lengths, t = [40, 21], 64
    pool, segs, conv, b_raw, a_raw, ssm_a, dt, outs = _long_forest(dev, gen, lengths, [3, 43], t)
    packed = _run_levels(pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk=16, dots=dots)
    packed_state = pool.base[outs[1] + LAYER * STATE :][:STATE].clone()
    alone_segs = segs[1:].clone()
    alone_segs[0, SEG_TOK_LO], alone_segs[0, SEG_LEVEL] = 0, 0
    idx = torch.arange(43, 64, device=dev)
    out = torch.zeros(21, HV, DV, device=dev)
    alone = (conv[idx], b_raw[idx], a_raw[idx], ssm_a, dt)
    prep = forest_gdn_prep(*alone, alone_segs, _qblocks(alone_segs), **KW, chunk=16, dots=dots)
    forest_gdn(
        *alone, pool.base, alone_segs, 0, LAYER * STATE, out, **KW, chunk=16, dots=dots, prep=prep
    )  # fmt: skip
    assert torch.equal(out, packed[43:64])
    assert torch.equal(pool.base[outs[1] + LAYER * STATE :][:STATE], packed_state)


def _qblocks(segs: torch.Tensor) -> torch.Tensor:
    """Query blocks of the live segments, in reverse (a table's order is not the kernel's concern)."""
    blocks = [
        [slot, lo, 1]
        for slot, r in enumerate(segs.tolist())
        if r[SEG_LIVE]
        for lo in range(0, r[SEG_LENGTH], 16)
    ]
    return torch.tensor([*blocks[::-1], [0, 0, 0]], dtype=torch.int64, device=segs.device)


def _chunk_oracle(
    conv: torch.Tensor, b_raw: torch.Tensor, a_raw: torch.Tensor, ssm_a: torch.Tensor, dt: torch.Tensor,
    lo: int, n: int, chunk: int, heads: tuple[int, int, int, int] = (HQK, HV, DK, DV),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """w, u and gam of one segment's rows in float64, T = (I + A)^-1 by torch.linalg.inv
    (heads: key heads, value heads, dk, dv)."""
    HQK, HV, DK, DV = heads  # noqa: N806 (the module's names, for other head sizes)
    x = conv[lo : lo + n].double()
    k = l2_normalize(x[:, HQK * DK : 2 * HQK * DK].reshape(n, HQK, DK)).repeat_interleave(HV // HQK, dim=1)
    v = x[:, 2 * HQK * DK :].reshape(n, HV, DV)
    beta = torch.sigmoid(b_raw[lo : lo + n].double())
    g = ssm_a.double() * F.softplus(a_raw[lo : lo + n].double() + dt.double())
    w, u, gam = torch.zeros(n, HV, DK, dtype=torch.float64), torch.zeros(n, HV, DV, dtype=torch.float64), []
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        gc = torch.cumsum(g[c0:c1], dim=0)  # [c, HV]
        gam.append(gc)
        for h in range(HV):
            kh = k[c0:c1, h]
            a = beta[c0:c1, h, None] * (kh @ kh.T) * torch.exp(gc[:, h, None] - gc[None, :, h])
            t = torch.linalg.inv(torch.eye(c1 - c0, dtype=torch.float64) + torch.tril(a, diagonal=-1))
            w[c0:c1, h] = t @ (kh * (beta[c0:c1, h] * torch.exp(gc[:, h]))[:, None])
            u[c0:c1, h] = t @ (v[c0:c1, h] * beta[c0:c1, h, None])
    return w, u, torch.cat(gam)


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunk_prep_matches_a_float64_inverse(chunk: int, dev: torch.device, gen: torch.Generator) -> None:
    """The state-free chunk products (w, u, gam) of segments of 40 and 21 tokens (full and
    partial chunks; at 32, query blocks that start no chunk) against float64 with T inverted by
    torch.linalg.inv. The keys share a common direction, so A is far from small and a truncated
    series for T would show."""
    lengths, t = [40, 21], 64
    pool, segs, conv, b_raw, a_raw, ssm_a, dt, _ = _long_forest(dev, gen, lengths, [3, 43], t)
    common = torch.randn(DK, generator=gen).to(dev)
    k = conv[:, HQK * DK : 2 * HQK * DK].view(t, HQK, DK)
    k.mul_(0.3).add_(common)  # k_i . k_j ~ 0.9 after normalisation
    prep = forest_gdn_prep(conv, b_raw, a_raw, ssm_a, dt, segs, _qblocks(segs), **KW, chunk=chunk)
    for lo, n in ((3, 40), (43, 21)):
        w, u, gam = _chunk_oracle(conv.cpu(), b_raw.cpu(), a_raw.cpu(), ssm_a.cpu(), dt.cpu(), lo, n, chunk)
        for got, want in ((prep.w, w), (prep.u, u), (prep.gam, gam)):
            got = got[lo : lo + n].double().cpu()
            err = (got - want).abs().max() / want.abs().max()
            assert err < 1e-5, (lo, err)


def test_chunk_options_are_checked(dev: torch.device, gen: torch.Generator) -> None:
    pool, segs, conv, b_raw, a_raw, ssm_a, dt, _ = _long_forest(dev, gen, [40, 21], [3, 43], 64)
    args = (conv, b_raw, a_raw, ssm_a, dt)
    qb = _qblocks(segs)
    with pytest.raises(ValueError, match="dots must be one of"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=16, dots="fp8")
    with pytest.raises(ValueError, match="power of two"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=24)
    with pytest.raises(ValueError, match="not a block of a live slot"):  # host tables: all on the CPU
        cpu_args = [a.cpu() for a in args]
        forest_gdn_prep(*cpu_args, segs.cpu(), torch.tensor([[0, 8, 1]]), **KW, chunk=16)
    with pytest.raises(ValueError, match="takes dots in"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=TC_CHUNK, dots="ieee")
    with pytest.raises(ValueError, match="bf16 dots need chunk"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=32, dots="bf16")
    with pytest.raises(ValueError, match="walk must be one of"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=TC_CHUNK, dots="bf16", walk="serial")
    with pytest.raises(ValueError, match="walk_bv a power of two"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=TC_CHUNK, dots="bf16", walk_bv=24)
    with pytest.raises(ValueError, match="walk_warps must be"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=TC_CHUNK, dots="bf16", walk_warps=3)
    with pytest.raises(ValueError, match="walk_stages 1 to 4"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=TC_CHUNK, dots="bf16", walk_stages=0)
    with pytest.raises(ValueError, match="prep_form must be one of"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=TC_CHUNK, dots="bf16", prep_form="solve")
    with pytest.raises(ValueError, match="prep_warps must be 4 or 8"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=TC_CHUNK, dots="bf16", prep_warps=2)
    with pytest.raises(ValueError, match="decayed must be one of"):
        forest_gdn_prep(*args, segs, qb, **KW, chunk=TC_CHUNK, dots="bf16", decayed="cached")
    with pytest.raises(ValueError, match="'stored' for the fused walk"):
        forest_gdn_prep(
            *args, segs, qb, **KW, chunk=TC_CHUNK, dots="bf16", walk="fused", decayed="recomputed"
        )
    tc = forest_gdn_prep(*args, segs, qb, **KW, chunk=TC_CHUNK, dots="bf16")
    with pytest.raises(ValueError, match="out must be contiguous fp32"):
        forest_gdn_outputs(tc, segs, torch.zeros(64, HV, DV + 1, device=dev))
    with pytest.raises(ValueError, match="rows must be contiguous int64"):
        forest_gdn_outputs(tc, segs, torch.zeros(64, HV, DV, device=dev), rows=torch.zeros(63, ROW_FIELDS))
    prep = forest_gdn_prep(*args, segs, qb, **KW, chunk=16)
    out = torch.zeros(64, HV, DV, device=dev)
    with pytest.raises(ValueError, match="prep is for chunk 16"):
        forest_gdn(*args, pool.base, segs, 0, LAYER * STATE, out, **KW, chunk=32, prep=prep)
    with pytest.raises(ValueError, match="pass prep="):
        forest_gdn(*args, pool.base, segs, 0, LAYER * STATE, out, **KW, chunk=16)
    with pytest.raises(ValueError, match="prep is for chunk 16, dots 'ieee'"):
        forest_gdn(*args, pool.base, segs, 0, LAYER * STATE, out, **KW, chunk=16, dots="tf32", prep=prep)


# unit roundoff of the chunk-64 form's dot operands (bf16: 8 significant bits, tf32: 11)
UNIT = {"bf16": 2.0**-8, "tf32": 2.0**-11}
TC_LENGTHS, TC_FIRST, TC_T = [150, 70], [3, 155], 232  # 3 and 2 chunks, neither a multiple of 64
# The prep forms of the slowest tests: "invert_split" is tested bit-equal to "invert" (every
# prep tensor, `test_tc_invert_split_equals_the_fused_invert`), so these would repeat its checks.
FUSED_PREP_FORMS = tuple(form for form in TC_PREP_FORMS if form != "invert_split")


def _compiled_or_skip(form: str, dev: torch.device, dk: int = DK, dv: int = DV) -> None:
    """The invert form runs compiled only at head sizes it was built for (`invert_compiles_for`;
    the interpreter runs every width): on CUDA the tiny test heads skip it."""
    if dev.type == "cuda" and form.startswith("invert") and not invert_compiles_for(dk, dv):
        pytest.skip(f"invert form not compiled for dk {dk}, dv {dv} (INVERT_HEAD_MULTIPLE)")


@pytest.mark.parametrize("form", FUSED_PREP_FORMS)
@pytest.mark.parametrize("dots", ["tf32", "bf16"])
def test_tc_chunks_equal_the_token_by_token_recurrence(
    dots: str, form: str, dev: torch.device, gen: torch.Generator
) -> None:
    """Chunk 64 on tensor cores over a stored-start root of 150 tokens and its child of 70
    (partial chunks, the child from its parent's final state): outputs and final states against
    the torch reference and the token-by-token kernel. Every dot operand is rounded to the
    format's unit u (relative); a chunk chains three products (w S, scores U, k^T U) into the
    state that the next chunk reads, five chunks deep here, so the error stays within a small
    multiple of u times the values' scale: 32 u (the interpreter rounds bf16 operands as the GPU
    does; it computes tf32 in fp32, so there the bound is loose)."""
    _compiled_or_skip(form, dev)
    pool, segs, conv, b_raw, a_raw, ssm_a, dt, outs = _long_forest(dev, gen, TC_LENGTHS, TC_FIRST, TC_T)
    before = pool.base.clone()
    got = _run_levels(pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk=TC_CHUNK, dots=dots, prep_form=form)
    got_states = [pool.base[o + LAYER * STATE :][:STATE].clone() for o in outs]
    pool.base.copy_(before)
    ref = _run_levels(pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk=0, backend="torch")
    ref_states = [pool.base[o + LAYER * STATE :][:STATE].clone() for o in outs]
    pool.base.copy_(before)
    step = _run_levels(pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk=0)
    rows = [*range(3, 153), *range(155, 225)]
    bound = 32 * UNIT[dots]
    for want in (ref[rows], step[rows]):
        assert (got[rows] - want).abs().max() <= bound * want.abs().max()
    for g, r in zip(got_states, ref_states, strict=True):
        assert (g - r).abs().max() <= bound * r.abs().max()
    assert not got[rows].isnan().any()
    untouched = torch.ones(TC_T, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(got[untouched], torch.zeros_like(got[untouched]))  # only live rows written


@pytest.mark.parametrize("dots", ["tf32", "bf16"])
def test_tc_split_walk_equals_the_fused_one(dots: str, dev: torch.device, gen: torch.Generator) -> None:
    """The split walk (only the state's products, storing each chunk's start state and updates)
    followed by the outputs of every chunk in parallel - per level, or once after the last level
    as the body does - reads the same operands and makes the same products as the fused walk:
    bit for bit on the interpreter; on the GPU the products' tiling differs, so to fp32
    accumulation rounding (far below the operands' unit u)."""
    pool, segs, conv, b_raw, a_raw, ssm_a, dt, outs = _long_forest(dev, gen, TC_LENGTHS, TC_FIRST, TC_T)
    before = pool.base.clone()
    runs = []
    split = dict(walk="split", decayed="stored")  # the operands the fused walk reads
    for tc in (dict(walk="fused"), split, dict(split, outputs=False)):
        pool.base.copy_(before)
        out = _run_levels(pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk=TC_CHUNK, dots=dots, **tc)
        runs.append((out, [pool.base[o + LAYER * STATE :][:STATE].clone() for o in outs]))
    (fused, fused_states), rest = runs[0], runs[1:]
    for out, states in rest:
        if dev.type == "cpu":
            assert torch.equal(out, fused)
            assert all(torch.equal(s, f) for s, f in zip(states, fused_states, strict=True))
        else:
            assert (out - fused).abs().max() <= UNIT[dots] / 16 * fused.abs().max()
            for s, f in zip(states, fused_states, strict=True):
                assert (s - f).abs().max() <= UNIT[dots] / 16 * f.abs().max()
    assert fused.abs().max() > 0


def _two_levels(
    dev: torch.device, gen: torch.Generator, heads: tuple[int, int, int, int]
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """The chunk-64 tests' root (150 tokens from row 3, from a stored state) and child (70 from
    row 155, level 1) at any head sizes: the inputs, segs, base (the stored state at 0, the
    root's final state at 1 block, the child's at 2) and the state block size."""
    hqk, hv, dk, dv = heads
    state = hv * dk * dv
    base = torch.zeros(3 * state + 64)
    base[:state] = torch.randn(state, generator=gen) * 0.3
    segs = torch.zeros(2, SEG_FIELDS, dtype=torch.int64)
    segs[:, SEG_LIVE] = 1
    fields = [SEG_TOK_LO, SEG_LENGTH, SEG_LEVEL, SEG_STATE_IN, SEG_HAS_STATE_IN, SEG_STATE_OUT]
    segs[0, fields] = torch.tensor([TC_FIRST[0], TC_LENGTHS[0], 0, 0, 1, state])
    segs[1, fields] = torch.tensor([TC_FIRST[1], TC_LENGTHS[1], 1, state, 1, 2 * state])
    conv = torch.randn(TC_T, 2 * hqk * dk + hv * dv, generator=gen)
    ab = torch.randn(TC_T, 2 * hv, generator=gen)
    rest = [-torch.rand(hv, generator=gen) - 0.1, torch.randn(hv, generator=gen) * 0.1]
    inputs = [a.to(dev) for a in (conv, ab[:, :hv], ab[:, hv:], *rest)]
    return inputs, segs.to(dev), base.to(dev), state


def _split_layer(
    inputs: list[torch.Tensor], segs: torch.Tensor, base: torch.Tensor, heads: tuple[int, int, int, int],
    qblocks: torch.Tensor | None = None, rows: torch.Tensor | None = None, **tc,
) -> torch.Tensor:  # fmt: skip
    """The body's order for a split chunk-64 prep: prep, the walk level by level, then every
    level's outputs in one launch (rows given: with the padding rows' zeros); out starts NaN."""
    hqk, hv, dk, dv = heads
    kw = dict(num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=TC_CHUNK)
    qb = _qblocks(segs) if qblocks is None else qblocks
    prep = forest_gdn_prep(*inputs, segs, qb, **kw, **tc)
    out = torch.full((inputs[0].shape[0], hv, dv), float("nan"), device=base.device)
    for level in range(2):
        forest_gdn(*inputs, base, segs, level, 0, out, **kw, dots=tc["dots"], prep=prep, outputs=False)
    forest_gdn_outputs(prep, segs, out, rows=rows)
    return out


TC_HEADS = {"tiny": (HQK, HV, DK, DV), "27B": (1, 3, 128, 128)}  # 27B: its head sizes, 3 value heads


@pytest.mark.parametrize("heads", TC_HEADS)
@pytest.mark.parametrize("form", FUSED_PREP_FORMS)
@pytest.mark.parametrize("dots", ["tf32", "bf16"])
def test_tc_recomputed_decays_equal_the_stored_ones(
    dots: str, form: str, heads: str, dev: torch.device, gen: torch.Generator
) -> None:
    """The split walk and the outputs making k exp(gam_last - gam) and q exp(gam) from the conv
    rows ("recomputed"; "recomputed_q": q's only) against reading the prep's stores ("stored"),
    over a root of 150 tokens from a stored state and its child of 70 (full and partial chunks;
    3 value heads share a key head at the 27B sizes): the same bits, outputs and final states,
    after either prep form.
    The prep is one build for both (a runtime switch of masked stores) and hands the walk and
    the outputs its row sums (q's and k's l2-norm scales) and each chunk's gam_last, so what
    they remake is elementwise: the prep's ops in its order, whatever layouts the kernels'
    compiles pick (on the GPU too; a row sum's order would follow its kernel's layout)."""
    if dev.type == "cuda" and form == "invert" and not invert_compiles_for(*TC_HEADS[heads][2:]):
        pytest.skip("invert form not compiled at these head sizes (INVERT_HEAD_MULTIPLE)")
    inputs, segs, base0, _ = _two_levels(dev, gen, TC_HEADS[heads])
    runs = {}
    for decayed in TC_DECAYED_FORMS:
        base = base0.clone()
        out = _split_layer(inputs, segs, base, TC_HEADS[heads], dots=dots, prep_form=form, decayed=decayed)
        runs[decayed] = out, base
    stored, stored_base = runs.pop("stored")
    live = torch.zeros(TC_T, dtype=torch.bool, device=dev)
    for lo, n in zip(TC_FIRST, TC_LENGTHS, strict=True):
        live[lo : lo + n] = True
    assert not stored[live].isnan().any() and stored[~live].isnan().all()  # only live rows written
    assert stored[live].abs().max() > 0
    for decayed, (got, got_base) in runs.items():
        assert got[~live].isnan().all(), decayed
        assert torch.equal(got[live], stored[live]), decayed
        assert torch.equal(got_base, stored_base), decayed


@pytest.mark.parametrize("decayed", TC_DECAYED_FORMS)
def test_tc_outputs_write_zeros_at_the_padding_rows(
    decayed: str, dev: torch.device, gen: torch.Generator
) -> None:
    """With the row table, the outputs launch also writes zeros at the padding rows (live 0:
    before, between and after the two segments), so the body hands it an uninitialised out; the
    live rows keep their bits. A query-block table listing only the chunk starts (5 blocks of
    16 rows for 232 rows) makes programs cover several row blocks each."""
    heads = TC_HEADS["tiny"]
    inputs, segs, base0, _ = _two_levels(dev, gen, heads)
    rows = torch.zeros(TC_T, ROW_FIELDS, dtype=torch.int64)
    for s, (lo, n) in enumerate(zip(TC_FIRST, TC_LENGTHS, strict=True)):
        rows[lo : lo + n, 0], rows[lo : lo + n, ROW_LOCAL], rows[lo : lo + n, ROW_LIVE] = (
            s,
            torch.arange(n),
            1,
        )
    rows = rows.to(dev)
    starts = torch.tensor([[s, c0, 1] for s, n in enumerate(TC_LENGTHS) for c0 in range(0, n, TC_CHUNK)])
    tc = dict(dots="bf16", decayed=decayed)
    want = _split_layer(inputs, segs, base0.clone(), heads, **tc)
    for qblocks in (None, starts.to(dev)):
        got = _split_layer(inputs, segs, base0.clone(), heads, qblocks=qblocks, rows=rows, **tc)
        live = rows[:, ROW_LIVE] != 0
        assert torch.equal(got[live], want[live])
        assert torch.equal(got[~live], torch.zeros_like(got[~live]))
        assert (~live).sum() == TC_T - sum(TC_LENGTHS)


def _tc_prep_oracle(
    conv: torch.Tensor, b_raw: torch.Tensor, a_raw: torch.Tensor, ssm_a: torch.Tensor, dt: torch.Tensor,
    lo: int, n: int, heads: tuple[int, int, int, int] = (HQK, HV, DK, DV),
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The chunk-64 prep's other products of one segment's rows in float64: q exp(gam),
    k exp(gam_last - gam) and the decayed causal scores exp(gam_r - gam_c) q_r.k_c (c <= r,
    zeros above the diagonal), chunk by chunk from the segment start."""
    HQK, HV, DK, _ = heads  # noqa: N806
    x = conv[lo : lo + n].double()
    group = HV // HQK
    q = l2_normalize(x[:, : HQK * DK].reshape(n, HQK, DK)).repeat_interleave(group, dim=1) * DK**-0.5
    k = l2_normalize(x[:, HQK * DK : 2 * HQK * DK].reshape(n, HQK, DK)).repeat_interleave(group, dim=1)
    g = ssm_a.double() * F.softplus(a_raw[lo : lo + n].double() + dt.double())
    qg, kd = torch.zeros(n, HV, DK, dtype=torch.float64), torch.zeros(n, HV, DK, dtype=torch.float64)
    scores = torch.zeros(n, HV, TC_CHUNK, dtype=torch.float64)
    for c0 in range(0, n, TC_CHUNK):
        c1 = min(c0 + TC_CHUNK, n)
        gc = torch.cumsum(g[c0:c1], dim=0)  # [c, HV]
        qg[c0:c1] = q[c0:c1] * torch.exp(gc)[:, :, None]
        kd[c0:c1] = k[c0:c1] * torch.exp(gc[-1] - gc)[:, :, None]
        s = torch.einsum("rhd,chd->rhc", q[c0:c1], k[c0:c1]) * torch.exp(gc[:, :, None] - gc.T[None])
        scores[c0:c1, :, : c1 - c0] = torch.tril(s.permute(1, 0, 2)).permute(1, 0, 2)
    return dict(qg=qg, kd=kd, scores=scores)


def _check_tc_prep(
    prep,
    inputs: list[torch.Tensor],
    spans: list[tuple[int, int]],
    dots: str,
    heads: tuple[int, int, int, int],
) -> None:
    """A chunk-64 prep's products of the segments at `spans` (first row, length) against the
    float64 oracles. Every rounding to the operand dtype costs at most 2 u (the interpreter
    truncates to bf16; the GPU rounds, 1 u): w and u see three (T, the other operand, the
    store), bounded against their scale; q exp(gam) and k exp(gam_last - gam) one (the store);
    the scores three, against |q| |k| = dk^-0.5 (their terms' scale: a score can be far smaller
    than its terms); gam (fp32, a sum of up to 64 terms) 64 fp32 half-ulps."""
    cpu = [x.cpu() for x in inputs]
    u_op = UNIT[dots]
    for lo, n in spans:
        w, u, gam = _chunk_oracle(*cpu, lo, n, TC_CHUNK, heads)
        want = dict(w=w, u=u, gam=gam, **_tc_prep_oracle(*cpu, lo, n, heads))
        scale = {name: x.abs().max().item() for name, x in want.items()} | dict(scores=heads[2] ** -0.5)
        bounds = dict(
            w=6 * u_op, u=6 * u_op, qg=2 * u_op, kd=2 * u_op, scores=6 * u_op, gam=TC_CHUNK * 2.0**-24
        )
        for name, bound in bounds.items():
            got = getattr(prep, name)[lo : lo + n].double().cpu()
            err = (got - want[name]).abs().max().item() / scale[name]
            assert err <= bound, (lo, name, err / u_op)


@pytest.mark.parametrize("form", TC_PREP_FORMS)
@pytest.mark.parametrize("dots", ["tf32", "bf16"])
def test_tc_prep_products_match_a_float64_oracle(
    dots: str, form: str, dev: torch.device, gen: torch.Generator
) -> None:
    """Each chunk-64 prep form's products (a root of 150 tokens and a child of 70: full and
    partial chunks) against float64 with T = (I + A)^-1 from torch.linalg.inv (bounds:
    `_check_tc_prep`). The keys share a common direction (k_i.k_j ~ 0.9), so A is far from
    small and an inverse that loses accuracy to cancellation would show."""
    _compiled_or_skip(form, dev)
    pool, segs, conv, b_raw, a_raw, ssm_a, dt, _ = _long_forest(dev, gen, TC_LENGTHS, TC_FIRST, TC_T)
    common = torch.randn(DK, generator=gen).to(dev)
    conv[:, HQK * DK : 2 * HQK * DK].view(TC_T, HQK, DK).mul_(0.3).add_(common)
    prep = forest_gdn_prep(
        conv, b_raw, a_raw, ssm_a, dt, segs, _qblocks(segs), **KW, chunk=TC_CHUNK, dots=dots, prep_form=form,
        decayed="stored",
    )  # fmt: skip
    spans = list(zip(TC_FIRST, TC_LENGTHS, strict=True))
    _check_tc_prep(prep, [conv, b_raw, a_raw, ssm_a, dt], spans, dots, (HQK, HV, DK, DV))


@pytest.mark.parametrize("form", TC_PREP_FORMS)
def test_tc_prep_products_at_the_model_head_size(form: str, dev: torch.device, gen: torch.Generator) -> None:
    """The 27B head size, dk = dv = 128 (the invert form makes w and u in two column blocks of
    64 there; the tiny heads take one of 16), one key head and two value heads, bf16: a
    100-token segment from row 5 (a full and a partial chunk) against the float64 oracles."""
    hqk, hv, dk, dv = 1, 2, 128, 128
    t, lo, n = 112, 5, 100
    segs = torch.zeros(2, SEG_FIELDS, dtype=torch.int64)
    segs[0, [SEG_TOK_LO, SEG_LENGTH, SEG_LIVE]] = torch.tensor([lo, n, 1])
    segs = segs.to(dev)
    x = torch.randn(t, 2 * hqk * dk + hv * dv, generator=gen)
    x[:, hqk * dk : 2 * hqk * dk] += torch.randn(dk, generator=gen)  # keys sharing a direction
    ab = torch.randn(t, 2 * hv, generator=gen)
    inputs = [
        x,
        ab[:, :hv],
        ab[:, hv:],
        -torch.rand(hv, generator=gen) - 0.1,
        torch.randn(hv, generator=gen) * 0.1,
    ]
    inputs = [a.to(dev) for a in inputs]
    prep = forest_gdn_prep(
        *inputs, segs, _qblocks(segs), num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv,
        chunk=TC_CHUNK, dots="bf16", prep_form=form, decayed="stored",
    )  # fmt: skip
    _check_tc_prep(prep, inputs, [(lo, n)], "bf16", (hqk, hv, dk, dv))


@pytest.mark.parametrize("form", TC_PREP_FORMS)
def test_tc_prep_rows_alone_equal_packed_at_the_model_head_size(
    form: str, dev: torch.device, gen: torch.Generator
) -> None:
    """The 27B head size (the width the invert form runs compiled at): a 70-token segment's
    products alone (its rows at 0, the tables listing only it) are the bits it gets packed after
    a 100-token one (from row 110), for every product the walk and the outputs read."""
    hqk, hv, dk, dv = 1, 2, 128, 128
    t = 192
    x = torch.randn(t, 2 * hqk * dk + hv * dv, generator=gen)
    ab = torch.randn(t, 2 * hv, generator=gen)
    rest = [-torch.rand(hv, generator=gen) - 0.1, torch.randn(hv, generator=gen) * 0.1]
    spans = [(5, 100), (110, 70)]
    segs = torch.zeros(3, SEG_FIELDS, dtype=torch.int64)
    for s, (lo, n) in enumerate(spans):
        segs[s, [SEG_TOK_LO, SEG_LENGTH, SEG_LIVE]] = torch.tensor([lo, n, 1])
    kw = dict(
        num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=TC_CHUNK, dots="bf16", prep_form=form,
        decayed="stored",
    )  # fmt: skip
    inputs = [a.to(dev) for a in (x, ab[:, :hv], ab[:, hv:], *rest)]
    packed = forest_gdn_prep(*inputs, segs.to(dev), _qblocks(segs.to(dev)), **kw)
    lo, n = spans[1]
    alone_segs = torch.zeros(1, SEG_FIELDS, dtype=torch.int64)
    alone_segs[0, [SEG_TOK_LO, SEG_LENGTH, SEG_LIVE]] = torch.tensor([0, n, 1])
    alone_segs = alone_segs.to(dev)
    rows = slice(lo, lo + n)
    alone_inputs = [inputs[0][rows], inputs[1][rows], inputs[2][rows], *inputs[3:]]
    alone = forest_gdn_prep(*alone_inputs, alone_segs, _qblocks(alone_segs), **kw)
    for name in ("w", "u", "qg", "kd", "scores", "gam"):
        assert torch.equal(getattr(alone, name)[:n], getattr(packed, name)[rows]), name


class _NanEmpty:
    """forest_gdn's `torch` with `empty` filled: NaN (floats) or -7 (integers), so that a test
    sees every element a launch did not write - the prep's outputs and its workspaces alike."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        x = torch.empty(*size, dtype=dtype, device=device)
        return x.fill_(float("nan") if dtype.is_floating_point else -7)


PREP_FIELDS = ("w", "u", "qg", "kd", "scores", "gam", "chunk_no", "q_norm", "k_norm", "gam_last")


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bit patterns (NaN payloads included), to compare tensors bit for bit."""
    return x.view({4: torch.int32, 2: torch.int16}[x.element_size()]) if x.is_floating_point() else x


@pytest.mark.parametrize("heads", TC_HEADS)
@pytest.mark.parametrize("dots", ["tf32", "bf16"])
def test_tc_invert_split_equals_the_fused_invert(
    dots: str, heads: str, dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "invert_split" prep (three kernels: scores and A, the inverse, w and u) against the
    fused invert kernel: every tensor of the prep bit for bit, NaN where neither wrote -
    a root of 150 tokens from row 3 and its child of 70 from row 155 (partial chunks, padding
    rows before, between and after), a padding slot, dead query-block records (one naming
    the padding slot), at the tiny heads (w and u in 16-column blocks) and the 27B ones (64;
    3 value heads on a key head). The outputs and the workspaces start as NaN, so a kernel
    that read a workspace row no kernel wrote (a chunk's rows past its segment end) would
    spread NaN into the live rows. "stored" and "recomputed" (q's and k's scales, gam_last)."""
    hqk, hv, dk, dv = TC_HEADS[heads]
    if dev.type == "cuda" and not invert_compiles_for(dk, dv):
        pytest.skip("invert form not compiled at these head sizes (INVERT_HEAD_MULTIPLE)")
    inputs, segs, _, _ = _two_levels(dev, gen, TC_HEADS[heads])
    pad = torch.zeros(1, SEG_FIELDS, dtype=torch.int64, device=dev)
    pad[0, [SEG_TOK_LO, SEG_LENGTH]] = torch.tensor([0, 20], device=dev)  # live 0: a padding slot
    segs = torch.cat([segs, pad])
    dead = torch.tensor([[2, 0, 0], [1, 0, 0]], dtype=torch.int64, device=dev)
    qblocks = torch.cat([_qblocks(segs), dead])
    monkeypatch.setattr(forest_gdn_module, "torch", _NanEmpty())
    kw = dict(num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=TC_CHUNK, dots=dots)
    live = torch.zeros(TC_T, dtype=torch.bool, device=dev)
    for lo, n in zip(TC_FIRST, TC_LENGTHS, strict=True):
        live[lo : lo + n] = True
    for decayed in ("stored", "recomputed"):
        fused, split = (
            forest_gdn_prep(*inputs, segs, qblocks, **kw, prep_form=form, decayed=decayed)
            for form in ("invert", "invert_split")
        )
        assert split.prep_form == "invert_split"
        for name in PREP_FIELDS:
            want, got = getattr(fused, name), getattr(split, name)
            assert torch.equal(_bits(got), _bits(want)), (decayed, name)
        assert not fused.w[live].isnan().any() and fused.w[~live].isnan().all()
        assert not fused.u[live].isnan().any() and fused.u[~live].isnan().all()
        assert fused.w[live].abs().max() > 0


def test_tc_invert_split_setting_runs_the_split_form(
    dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TC_INVERT_SPLIT (the engine's switch: the body asks for "invert") runs "invert_split".
    Compiled, the invert forms run only at head sizes they are built for: the 27B heads there."""
    hqk, hv, dk, dv = heads = TC_HEADS["27B" if dev.type == "cuda" else "tiny"]
    kw = dict(num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=TC_CHUNK, dots="bf16")
    inputs, segs, _, _ = _two_levels(dev, gen, heads)
    monkeypatch.setattr(forest_gdn_module, "TC_INVERT_SPLIT", True)
    prep = forest_gdn_prep(*inputs, segs, _qblocks(segs), **kw, prep_form="invert")
    assert prep.prep_form == "invert_split"
    rows = inputs[0].shape[0]
    for bound, form in ((rows, "invert_split"), (rows + 1, "invert")):  # TC_INVERT_SPLIT_MIN_ROWS
        monkeypatch.setattr(forest_gdn_module, "TC_INVERT_SPLIT_MIN_ROWS", bound)
        prep = forest_gdn_prep(*inputs, segs, _qblocks(segs), **kw, prep_form="invert")
        assert prep.prep_form == form, bound


@pytest.mark.parametrize("form", TC_PREP_FORMS)
@pytest.mark.parametrize("dots", ["tf32", "bf16"])
def test_tc_segment_bits_do_not_depend_on_the_launch(
    dots: str, form: str, dev: torch.device, gen: torch.Generator
) -> None:
    """Chunk 64: the root alone, and the child alone from its parent's cached final state, give
    the bits they have packed together (the child's rows at 0, the tables listing only it)."""
    _compiled_or_skip(form, dev)
    pool, segs, conv, b_raw, a_raw, ssm_a, dt, outs = _long_forest(dev, gen, TC_LENGTHS, TC_FIRST, TC_T)
    packed = _run_levels(pool, segs, conv, b_raw, a_raw, ssm_a, dt, chunk=TC_CHUNK, dots=dots, prep_form=form)
    packed_states = [pool.base[o + LAYER * STATE :][:STATE].clone() for o in outs]
    for s, (lo, n) in enumerate(zip(TC_FIRST, TC_LENGTHS, strict=True)):
        alone_segs = segs[s : s + 1].clone()
        alone_segs[0, SEG_TOK_LO], alone_segs[0, SEG_LEVEL] = 0, 0
        pool.base[outs[s] + LAYER * STATE :][:STATE] = 7.0  # spoiled: must be rewritten
        idx = torch.arange(lo, lo + n, device=dev)
        out = torch.zeros(n, HV, DV, device=dev)
        alone = (conv[idx], b_raw[idx], a_raw[idx], ssm_a, dt)
        prep = forest_gdn_prep(
            *alone, alone_segs, _qblocks(alone_segs), **KW, chunk=TC_CHUNK, dots=dots, prep_form=form
        )
        forest_gdn(
            *alone, pool.base, alone_segs, 0, LAYER * STATE, out, **KW, chunk=TC_CHUNK, dots=dots, prep=prep
        )  # fmt: skip
        assert torch.equal(out, packed[lo : lo + n]), s
        assert torch.equal(pool.base[outs[s] + LAYER * STATE :][:STATE], packed_states[s]), s


@pytest.mark.parametrize("form", TC_PREP_FORMS)
@pytest.mark.parametrize("dots", ["tf32", "bf16"])
def test_tc_chunks_over_the_three_level_forest(
    dots: str, form: str, dev: torch.device, gen: torch.Generator
) -> None:
    """Chunk 64 over the packed forest of short segments (every one shorter than a chunk, an
    empty one, stored starts, three levels, a padding slot and padding rows): each chain's
    outputs and final states against the chain run as one sequence, within 32 u of the
    values' scale; nothing outside the live rows and state blocks is written."""
    _compiled_or_skip(form, dev)
    case = _case(dev, gen)
    case.pool.base.copy_(case.before)
    y = forest_conv(case.x, case.weight, case.pool.base, case.rows, case.segs, case.conv_src, case.conv_off)
    after_conv = case.pool.base.clone()
    out = torch.full((y.shape[0], HV, DV), float("nan"), device=dev)
    qb = _qblocks(case.segs)
    prep = forest_gdn_prep(
        y, case.b_raw, case.a_raw, case.ssm_a, case.dt, case.segs, qb, **KW, chunk=TC_CHUNK, dots=dots,
        prep_form=form,
    )  # fmt: skip
    for level in range(3):  # the body's order: the split walk level by level, then all outputs
        forest_gdn(
            y, case.b_raw, case.a_raw, case.ssm_a, case.dt, case.pool.base, case.segs, level, LAYER * STATE,
            out, **KW, chunk=TC_CHUNK, dots=dots, prep=prep, outputs=False,
        )  # fmt: skip
    forest_gdn_outputs(prep, case.segs, out)
    bound = 32 * UNIT[dots]
    for s in NODES:
        _, o_o, state_o, _ = _oracle(case, s)
        if NODES[s][1]:
            got = out[case.seg_rows(s)]
            assert (got - o_o).abs().max() <= bound * o_o.abs().max().clamp(min=1e-3), s
        assert (_state_out(case, s) - state_o).abs().max() <= bound * state_o.abs().max(), s
    pad = case.rows[:, ROW_LIVE] == 0
    assert out[pad].isnan().all()
    keep = ~_written(case, conv=False, state=True)
    assert torch.equal(case.pool.base[keep], after_conv[keep])
    assert torch.equal(_state_out(case, 5), _state_out(case, 1))  # the empty child hands its state on


# ------------------------------------------------------------------ the conv over long segments
# slot -> (parent slot or None, length) of the conv's long case (slot 5: a padding slot)
LONG_NODES: dict[int, tuple[int | None, int]] = {
    0: (None, 45), 1: (0, 37), 2: (None, 2), 3: (2, 40), 4: (0, 0), 6: (None, 33)
}  # fmt: skip


def _long_conv_case(dev: torch.device, gen: torch.Generator, c: int, w: int = 4):
    """A packed pass of long and short segments for the conv alone: a stored-start root of 45
    rows, its child of 37 (sources: the root's last rows), an empty child of the root, a
    zero-start root of 2 rows and its child of 40 (sources: zero, row, row), a zero-start root
    of 33, padding rows between them and a padding slot. Blocks of 4..64 rows then lie inside
    one segment past its start (the direct path), across boundaries and padding, or at starts."""
    nodes = LONG_NODES
    order = [None] * 3 + [0, 1, None, 2, 3, None, None, 6]
    s_count = 7  # slot 5: padding
    tail = c * (w - 1)
    pool = Pool((len(nodes) + 2) * N_GDN * tail + 64, dev, gen)
    stored = pool.take(N_GDN * tail)
    out = {s: pool.take(N_GDN * tail) for s in nodes}
    rows: list[list[int]] = []
    first: dict[int, int] = {}
    for s in order:
        if s is None:
            rows.append([1000, 99, 0, 0])
            continue
        first[s] = len(rows)
        rows += [[s, i, 1, 0] for i in range(nodes[s][1])]
    first[4] = 0
    t = len(rows)
    before: dict[int, list[list[int]]] = {
        0: [[CONV_TAIL, stored + k] for k in range(w - 1)],
        2: [[CONV_ZERO, 0]] * (w - 1),
        6: [[CONV_ZERO, 0]] * (w - 1),
    }
    for s in (1, 4, 3):
        parent = nodes[s][0]
        p_rows = range(first[parent], first[parent] + nodes[parent][1])
        before[s] = (before[parent] + [[CONV_ROW, r] for r in p_rows])[-(w - 1) :]
    segs = torch.zeros(s_count, SEG_FIELDS, dtype=torch.int64)
    src = torch.zeros(s_count, w - 1, 2, dtype=torch.int64)
    for s, (_, n) in nodes.items():
        segs[s, [SEG_TOK_LO, SEG_LENGTH, SEG_CONV_OUT, SEG_LIVE]] = torch.tensor([first[s], n, out[s], 1])
        src[s] = torch.tensor(before[s])
    segs[5, [SEG_TOK_LO, SEG_LENGTH, SEG_CONV_OUT]] = torch.tensor([3, 10, stored])  # dead: never written
    src[5, :, 0] = CONV_TAIL
    wide = torch.randn(t, c + 8, generator=gen)
    x = wide.to(dev)[:, 5 : 5 + c]
    weight = (torch.randn(c, w, generator=gen) * 0.5).to(dev)
    return x, weight, pool, torch.tensor(rows, dtype=torch.int64).to(dev), segs.to(dev), src.to(dev)


# (BT, BC, warps, BG); 64 rows a block: every block of the case takes the general path
@pytest.mark.parametrize(
    "config", [(4, 16, 1, 2), (8, 32, 2, 4), (32, 128, 8, 4), (32, 64, 4, 32), (64, 128, 4, 8)]
)
def test_conv_bits_do_not_depend_on_the_tiling(
    dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, config: tuple[int, ...]
) -> None:
    """The conv under another tiling gives the default tiling's bits, outputs and final tails,
    and matches the reference. A row's block lies inside one segment past its start (its
    windows read directly) at one tiling and across a boundary (the general path, the first
    W - 1 rows through the tables) at another: the bits of the two paths are compared too."""
    import engine.kernels.forest_gdn as fg

    c = 72  # channel blocks of 16..128 with a ragged last one
    x, weight, pool, rows, segs, src = _long_conv_case(dev, gen, c)
    before = pool.base.clone()
    off = LAYER * c * 3

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        pool.base.copy_(before)
        y = forest_conv(x, weight, pool.base, rows, segs, src, off)
        return y, pool.base.clone()

    y_def, base_def = run()
    bt, bc, warps, bg = config
    monkeypatch.setattr(fg, "CONV_BLOCK_T", bt)
    monkeypatch.setattr(fg, "CONV_BLOCK_C", bc)
    monkeypatch.setattr(fg, "CONV_WARPS", warps)
    monkeypatch.setattr(fg, "CONV_GENERAL_ROWS", bg)
    y_new, base_new = run()
    assert torch.equal(y_new, y_def)
    assert torch.equal(base_new, base_def)
    pool.base.copy_(before)
    y_ref = forest_conv_reference(x, weight, pool.base, rows, segs, src, off)
    torch.testing.assert_close(y_new, y_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(base_new, pool.base)  # final tails: copies of inputs, exact; nothing else written
    assert not y_new[rows[:, ROW_LIVE] == 0].any()  # padding rows: zeros


def test_conv_rows_equal_the_decode_steps(dev: torch.device, gen: torch.Generator) -> None:
    """Every segment's conv rows and final tail equal its root-to-segment chain fed token by
    token to the decode step's conv kernel (`conv_step`: the same window sum and SiLU, written
    separately), bit for bit: blocks read directly, segment starts through ancestors' rows,
    stored and zero starts, and an empty segment's tail (its parent's)."""
    c = 72
    x, weight, pool, rows, segs, src = _long_conv_case(dev, gen, c)
    off = LAYER * c * 3
    before = pool.base.clone()
    y = forest_conv(x, weight, pool.base, rows, segs, src, off)
    stored = int(src[0, 0, 1])  # root 0's sources: the stored tail block's columns

    def chain(s: int) -> list[int]:
        parent = LONG_NODES[s][0]
        return [s] if parent is None else [*chain(parent), s]

    def own(s: int) -> list[int]:
        lo, n = int(segs[s, SEG_TOK_LO]), int(segs[s, SEG_LENGTH])
        return list(range(lo, lo + n))

    slots = list(LONG_NODES)
    tokens = [[r for a in chain(s) for r in own(a)] for s in slots]
    # one decode row per segment, its [C, 3] tail block at i * 3C of dbase: zeros or the stored tail
    dbase = torch.zeros(len(slots) * c * 3, device=dev)
    for i, s in enumerate(slots):
        if chain(s)[0] == 0:
            dbase[i * c * 3 : (i + 1) * c * 3] = before[stored + off : stored + off + c * 3]
    drows = torch.zeros(len(slots), DECODE_ROW_FIELDS, dtype=torch.int64)
    drows[:, CONV_OFF] = torch.arange(len(slots)) * c * 3
    y_dec = {}
    for step in range(max(map(len, tokens))):
        drows[:, LIVE] = torch.tensor([int(step < len(t)) for t in tokens])
        feed = [t[step] if step < len(t) else 0 for t in tokens]
        y_step = conv_step(x[feed], weight, dbase, drows.to(dev), 0)
        for i, t in enumerate(tokens):
            if step < len(t):
                y_dec[i, t[step]] = y_step[i]
    for i, s in enumerate(slots):
        for r in own(s):
            assert torch.equal(y[r], y_dec[i, r]), (s, r)
        out = int(segs[s, SEG_CONV_OUT]) + off
        assert torch.equal(pool.base[out : out + c * 3], dbase[i * c * 3 : (i + 1) * c * 3]), s
