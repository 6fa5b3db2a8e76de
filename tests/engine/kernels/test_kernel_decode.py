"""Decode-step kernels (conv/GDN step, attention prep + piece attention, fused quantization)
against their torch references, and row by row: a row's bits alone equal its bits in a batch.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.decode_attention import AttentionHeads, PrepInputs, attention_prep, decode_attention
from engine.kernels.decode_gdn import conv_step, gdn_step
from engine.kernels.decode_quant import gated_norm_quantize, swiglu_quantize
from engine.kernels.decode_rows import CONV_OFF, LIVE, ROW_FIELDS, STATE_OFF, THOUGHT_LEN
from engine.model.config import ModelConfig
from engine.run.reference import rope_cos_sin
from engine.testing.make_model import dims_config
from tests.engine.kernels.pool import Pool


def _rows(b: int, dev: torch.device, **fields: list[int]) -> torch.Tensor:
    rows = torch.zeros(b, ROW_FIELDS, dtype=torch.int64)
    rows[:, LIVE] = 1
    for name, values in fields.items():
        rows[:, {"tlen": THOUGHT_LEN, "state": STATE_OFF, "conv": CONV_OFF, "live": LIVE}[name]] = (
            torch.tensor(values)
        )
    return rows.to(dev)


def _assert_rows_independent(run, b: int) -> None:
    """run(order) -> per-row outputs for rows in `order`; each row must equal its value alone."""
    full = run(list(range(b)))
    for r in range(b):
        alone = run([r])
        for a, f in zip(alone, full, strict=True):
            assert torch.equal(a[0], f[r]), r


@pytest.mark.parametrize("blocks_first", [False, True])
def test_conv_step_matches_reference_and_shifts_the_tail(
    blocks_first: bool, dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In both of `decode_gdn.BLOCKS_FIRST`'s dispatch orders (channel block or row fastest)."""
    import engine.kernels.decode_gdn as decode_gdn

    monkeypatch.setattr(decode_gdn, "BLOCKS_FIRST", blocks_first)
    b, c, layers = 5, 200, 2
    pool = Pool(b * layers * c * 3 + 64, dev, gen)
    offs = [pool.take(layers * c * 3) for _ in range(b)]
    x = torch.randn(b, c, generator=gen).to(dev)
    w = torch.randn(c, 4, generator=gen).to(dev)
    rows = _rows(b, dev, conv=offs, live=[1, 1, 0, 1, 1])
    layer_off = c * 3
    before = pool.base.clone()
    y = conv_step(x, w, pool.base, rows, layer_off, backend="triton")
    after_kernel = pool.base.clone()
    pool.base.copy_(before)
    y_ref = conv_step(x, w, pool.base, rows, layer_off, backend="torch")
    torch.testing.assert_close(y[[0, 1, 3, 4]], y_ref[[0, 1, 3, 4]], rtol=1e-5, atol=1e-6)
    assert torch.equal(after_kernel, pool.base)  # tails shifted exactly; the padding row untouched
    assert torch.equal(
        after_kernel[offs[2] : offs[2] + layers * c * 3], before[offs[2] : offs[2] + layers * c * 3]
    )

    def run(order: list[int]) -> list[torch.Tensor]:
        pool.base.copy_(before)
        out = conv_step(x[order], w, pool.base, rows[order].contiguous(), layer_off, backend="triton")
        tails = torch.stack([pool.base[offs[r] + layer_off : offs[r] + 2 * layer_off] for r in order])
        return [out, tails]

    _assert_rows_independent(run, b)


def _check_gdn_step_against_reference(
    cfg: ModelConfig, dev: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step kernel's output and updated state match the torch reference, and each row's bits
    do not depend on the rows beside it or their order. Returns the kernel's output and the state
    pool after it (the same `gen` state gives the same case)."""
    hqk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    b = 4
    block = hv * dk * dv
    pool = Pool(b * 2 * block + 64, dev, gen)
    pool.base.mul_(0.1)
    offs = [pool.take(2 * block) for _ in range(b)]
    conv = torch.randn(b, 2 * hqk * dk + hv * dv, generator=gen).to(dev)
    b_raw = torch.randn(b, hv, generator=gen).to(dev)
    a_raw = (torch.randn(b, hv, generator=gen) * 3).to(dev)
    a_raw[0, 0] = 25.0  # past softplus' threshold
    ssm_a = (-torch.rand(hv, generator=gen) * 2).to(dev)
    dt = torch.randn(hv, generator=gen).to(dev)
    rows = _rows(b, dev, state=offs)
    kw = dict(num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv)
    before = pool.base.clone()
    o = gdn_step(conv, b_raw, a_raw, ssm_a, dt, pool.base, rows, block, **kw, backend="triton")
    after_kernel = pool.base.clone()
    pool.base.copy_(before)
    o_ref = gdn_step(conv, b_raw, a_raw, ssm_a, dt, pool.base, rows, block, **kw, backend="torch")
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(after_kernel, pool.base, rtol=1e-4, atol=1e-5)
    assert not torch.equal(after_kernel, before)  # the step wrote the states

    def run(order: list[int]) -> list[torch.Tensor]:
        pool.base.copy_(before)
        idx = torch.tensor(order, device=dev)
        out = gdn_step(
            conv[idx], b_raw[idx], a_raw[idx], ssm_a, dt, pool.base, rows[idx].contiguous(), block, **kw
        )
        states = torch.stack([pool.base[offs[r] + block : offs[r] + 2 * block] for r in order])
        return [out, states]

    _assert_rows_independent(run, b)
    return o, after_kernel


@pytest.mark.parametrize("dims", ["tiny", "small"])
def test_gdn_step_matches_reference(dims: str, dev: torch.device, gen: torch.Generator) -> None:
    _check_gdn_step_against_reference(dims_config(dims), dev, gen)


@pytest.mark.parametrize("setting", [("BLOCK_V", 64), ("BLOCK_V", 128), ("NUM_WARPS", 8)])
def test_gdn_step_settings_match_reference(
    setting: tuple[str, int], dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's value-block width and warps (bench variants `tc64inv-gdnstepv64` / `-gdnstepw8`)
    keep the kernel's contract: the reference's values, rows independent of their batch. They are
    not promised the default's bits: compiled, the block shape sets the register layout and with it
    the order of the sum over dk (H200: BLOCK_V 64 moved bits), so taking one as the default is a
    version change of the decode bits."""
    import engine.kernels.decode_gdn as decode_gdn

    monkeypatch.setattr(decode_gdn, setting[0], setting[1])
    _check_gdn_step_against_reference(dims_config("small", linear_value_head_dim=128), dev, gen)


def test_gdn_step_bits_do_not_depend_on_the_dispatch_order(
    dev: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`decode_gdn.BLOCKS_FIRST` only reorders the programs (value block fastest, the default, or
    row fastest): in each order the contract holds (reference values, rows independent of their
    batch), and on the same case every output and every state word are the same in both."""
    import engine.kernels.decode_gdn as decode_gdn

    cfg = dims_config("small", linear_value_head_dim=128)
    results = []
    for first in (False, True):
        monkeypatch.setattr(decode_gdn, "BLOCKS_FIRST", first)
        results.append(_check_gdn_step_against_reference(cfg, dev, torch.Generator().manual_seed(33)))
    (o_rows, states_rows), (o_blocks, states_blocks) = results
    assert torch.equal(o_rows, o_blocks)
    assert torch.equal(states_rows, states_blocks)


def _attention_case(dims: str, dev: torch.device, gen: torch.Generator, b: int = 4):
    cfg = dims_config(dims)
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    lengths = [[7, 40, 3], [7, 0, 70], [7, 129, 1], [7, 5, 9]][:b]  # ancestors per row (0: unused piece)
    tlens = [0, 5, 2, 63][:b]
    caps = [4, 8, 8, 64]
    pool = Pool(b * (sum(map(sum, lengths)) + 2 * 64) * nkv * hd * 2 + 4096, dev, gen)
    pieces = torch.zeros(b, 4, 4, dtype=torch.int64)
    for r in range(b):
        for p, n in enumerate(lengths[r]):
            pieces[r, p] = torch.tensor([pool.take(nkv * n * hd), pool.take(nkv * n * hd), n, n])
        pieces[r, 3] = torch.tensor(
            [pool.take(nkv * caps[r] * hd), pool.take(nkv * caps[r] * hd), 0, caps[r]]
        )
    pieces = pieces.to(dev)
    rows = _rows(b, dev, tlen=tlens)
    positions = torch.tensor([sum(lengths[r]) + tlens[r] for r in range(b)])
    cos, sin = rope_cos_sin(cfg, positions, torch.float32)
    rope = torch.stack([cos, sin], dim=1).to(dev)
    qg = torch.randn(b, nh * 2 * hd, generator=gen).to(dev)
    k = torch.randn(b, nkv * hd, generator=gen).to(dev)
    v = torch.randn(b, nkv * hd, generator=gen).to(dev)
    q_norm = (1 + 0.1 * torch.randn(hd, generator=gen)).to(dev)
    k_norm = (1 + 0.1 * torch.randn(hd, generator=gen)).to(dev)
    heads = AttentionHeads(nh, nkv, hd, cfg.rms_norm_eps)
    return pool, PrepInputs(qg, k, v, q_norm, k_norm, rope), rows, pieces, heads


@pytest.mark.parametrize("dims", ["tiny", "small"])
@pytest.mark.parametrize("splits", [None, 1, 2])  # None: SPLITS (more programs than chunks)
def test_attention_prep_and_piece_attention_match_reference(
    dims: str, splits: int | None, dev: torch.device, gen: torch.Generator
) -> None:
    pool, x, rows, pieces, heads = _attention_case(dims, dev, gen)
    nkv = heads.num_kv_heads
    before = pool.base.clone()
    q = attention_prep(x, pool.base, rows, pieces, heads, backend="triton")
    out = decode_attention(q, x.qg, pool.base, rows, pieces, num_kv_heads=nkv, splits=splits)
    after_kernel = pool.base.clone()
    pool.base.copy_(before)
    q_ref = attention_prep(x, pool.base, rows, pieces, heads, backend="torch")
    out_ref = decode_attention(q_ref, x.qg, pool.base, rows, pieces, num_kv_heads=nkv, backend="torch")
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after_kernel, pool.base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2])
def test_tensor_core_dots_stay_near_the_reference(
    splits: int, dev: torch.device, gen: torch.Generator
) -> None:
    """bf16 dots (q, k, the probabilities and v rounded to bf16, fp32 sums): within bf16's
    rounding of the fp32 reference, on the pieces' real cascade."""
    pool, x, rows, pieces, heads = _attention_case("small", dev, gen)
    qg, nkv = x.qg, heads.num_kv_heads
    q = attention_prep(x, pool.base, rows, pieces, heads, backend="triton")
    out = decode_attention(q, qg, pool.base, rows, pieces, num_kv_heads=nkv, splits=splits, dots="bf16")
    ref = decode_attention(q, qg, pool.base, rows, pieces, num_kv_heads=nkv, backend="torch")
    err = (out - ref).abs().max().item()
    assert 0 < err <= 3e-2, err  # rounded (not the fp32 path) and close (bf16: 8 bits of mantissa)
    with pytest.raises(ValueError, match="dots"):
        decode_attention(q, qg, pool.base, rows, pieces, num_kv_heads=nkv, dots="fp8")


@pytest.mark.parametrize(("splits", "dots"), [(None, "ieee"), (1, "ieee"), (3, "ieee"), (3, "bf16")])
def test_piece_attention_rows_are_independent(
    splits: int | None, dots: str, dev: torch.device, gen: torch.Generator
) -> None:
    pool, x, rows, pieces, heads = _attention_case("tiny", dev, gen)
    base = pool.base
    before = pool.base.clone()

    def run(order: list[int]) -> list[torch.Tensor]:
        pool.base.copy_(before)
        idx = torch.tensor(order, device=dev)
        sub = x._replace(qg=x.qg[idx], k=x.k[idx], v=x.v[idx], rope=x.rope[idx].contiguous())
        q = attention_prep(sub, base, rows[idx].contiguous(), pieces[idx].contiguous(), heads)
        out = decode_attention(
            q,
            sub.qg,
            base,
            rows[idx].contiguous(),
            pieces[idx].contiguous(),
            num_kv_heads=2,
            splits=splits,
            dots=dots,
        )
        return [q, out]

    _assert_rows_independent(run, 4)


def test_fused_quantizations_match_reference(dev: torch.device, gen: torch.Generator) -> None:
    b, hv, dv, k = 6, 4, 16, 300
    o = torch.randn(b, hv, dv, generator=gen).to(dev)
    z = torch.randn(b, hv * dv, generator=gen).to(dev)
    w = torch.rand(dv, generator=gen).to(dev) + 0.5
    div = torch.rand(hv * dv, generator=gen).to(dev) + 0.5
    gate, up = torch.randn(b, k, generator=gen).to(dev), torch.randn(b, k, generator=gen).to(dev)
    gate_up = torch.stack((gate, up), -1).flatten(1)  # interleaved: gate j at 2j, up j at 2j + 1
    sdiv = torch.rand(k, generator=gen).to(dev) + 0.5
    cases = [
        (lambda be, d: gated_norm_quantize(o, z, w, d, 1e-6, backend=be), div),
        (lambda be, d: swiglu_quantize(gate_up, d, backend=be), sdiv),
    ]
    for fn, d in cases:
        for divisor in (None, d):
            q, s = fn("triton", divisor)
            q_ref, s_ref = fn("torch", divisor)
            torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
            # the kernel's float op agrees to rounding, so a value on a rounding boundary may differ by 1
            assert (q.int() - q_ref.int()).abs().max() <= 1
            assert (q != q_ref).float().mean() < 0.01
    # rows alone equal rows in the batch
    q_all, s_all = gated_norm_quantize(o, z, w, div, 1e-6)
    g_all, gs_all = swiglu_quantize(gate_up, sdiv)
    for r in range(b):
        q1, s1 = gated_norm_quantize(o[r : r + 1], z[r : r + 1], w, div, 1e-6)
        g1, gs1 = swiglu_quantize(gate_up[r : r + 1], sdiv)
        assert torch.equal(q1[0], q_all[r]) and torch.equal(s1[0], s_all[r])
        assert torch.equal(g1[0], g_all[r]) and torch.equal(gs1[0], gs_all[r])


def _gated_case(
    b: int, hv: int, dv: int, dev: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """o [b, hv, dv] (row 1 zero: scale 0), z a column slice of a wider GEMM output (as the
    engine's), the norm's weight and a SmoothQuant divisor."""
    o = (torch.randn(b, hv, dv, generator=gen) * 3).to(dev)
    o[1] = 0.0
    z = (torch.randn(b, hv * dv + 24, generator=gen) * 2).to(dev)[:, 8 : 8 + hv * dv]
    w = (torch.rand(dv, generator=gen) + 0.5).to(dev)
    div = (torch.rand(hv * dv, generator=gen) + 0.5).to(dev)
    return o, z, w, div


# The gated norm's "blocks" form (`decode_quant.GATED_FORM`): (hv, dv, setting, compiled too).
# At dv 128, tiles of at least 16 values a thread lay a head over 8 lanes of 16 values, as the
# padded form does (`test_gated_norm_forms_sum_in_one_layout`), so compiled they give its bits
# as well; the tiny heads' tiles (a few values a thread) are laid out otherwise by each form, so
# they are compared in the interpreter only, which has no layouts.
_GATED_BLOCKS = [
    (
        48,
        128,
        dict(GATED_BLOCK_HEADS=16, GATED_BLOCK_WARPS=4),
        True,
    ),  # 27B: 3 tiles of 16 heads (the default)
    (48, 128, dict(GATED_BLOCK_HEADS=16, GATED_BLOCK_WARPS=4, GATED_Z_AHEAD=False), True),  # z loaded late
    (32, 128, dict(GATED_BLOCK_HEADS=16, GATED_BLOCK_WARPS=4), True),  # 4B and 9B: 2 tiles
    (48, 128, dict(GATED_BLOCK_HEADS=8, GATED_BLOCK_WARPS=2), True),  # 6 tiles of 8 heads, 16 values a thread
    (
        12,
        16,
        dict(GATED_BLOCK_HEADS=8, GATED_BLOCK_WARPS=1),
        False,
    ),  # the last tile ragged (heads 12..15 masked)
    (3, 8, dict(GATED_BLOCK_HEADS=2, GATED_BLOCK_WARPS=1, GATED_Z_AHEAD=False), False),
]


@pytest.mark.parametrize(("hv", "dv", "setting", "compiled"), _GATED_BLOCKS)
def test_gated_norm_blocks_give_the_padded_bits(
    dev: torch.device,
    gen: torch.Generator,
    monkeypatch: pytest.MonkeyPatch,
    hv: int,
    dv: int,
    setting: dict,
    compiled: bool,
) -> None:
    """The row as tiles of heads, all of o (and z) loaded first, gives the padded tile's codes
    and scales, with and without a divisor, a zero row among them, and a row alone its bits in
    the batch."""
    import engine.kernels.decode_quant as dq

    if dev.type == "cuda" and not compiled:
        pytest.skip("the tiny heads' tiles are laid out otherwise by each form: interpreter only")

    o, z, w, div = _gated_case(64 if dev.type == "cuda" else 3, hv, dv, dev, gen)
    for divisor in (None, div):
        monkeypatch.setattr(dq, "GATED_FORM", "padded")
        want = dq.gated_norm_quantize(o, z, w, divisor, 1e-6)
        monkeypatch.setattr(dq, "GATED_FORM", "blocks")
        for name, value in setting.items():
            monkeypatch.setattr(dq, name, value)
        got = dq.gated_norm_quantize(o, z, w, divisor, 1e-6)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(got[1][1], torch.zeros((), device=dev))  # the zero row
        alone = dq.gated_norm_quantize(o[2:3], z[2:3], w, divisor, 1e-6)
        assert torch.equal(alone[0][0], got[0][2]) and torch.equal(alone[1][0], got[1][2])


@pytest.mark.parametrize(("heads", "warps"), [(8, 8), (8, 4), (16, 8), (64, 4)])
def test_gated_norm_block_settings_match_reference(
    dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, heads: int, warps: int
) -> None:
    """The blocks form at the 27B row under settings that may lay a head's sum out otherwise
    (fewer than 16 values a thread; a tile wider than the row): the torch reference's values to
    rounding, and one rule for every batch (a row alone its bits in the batch)."""
    import engine.kernels.decode_quant as dq

    o, z, w, div = _gated_case(64 if dev.type == "cuda" else 3, 48, 128, dev, gen)
    monkeypatch.setattr(dq, "GATED_FORM", "blocks")
    monkeypatch.setattr(dq, "GATED_BLOCK_HEADS", heads)
    monkeypatch.setattr(dq, "GATED_BLOCK_WARPS", warps)
    q, s = dq.gated_norm_quantize(o, z, w, div, 1e-6)
    q_ref, s_ref = dq.gated_norm_quantize(o, z, w, div, 1e-6, backend="torch")
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # the kernel's float ops agree to rounding, so a value on a rounding boundary may differ by 1
    assert (q.int() - q_ref.int()).abs().max() <= 1
    assert (q != q_ref).float().mean() < 0.01
    for r in (0, 1, q.shape[0] - 1):
        q1, s1 = dq.gated_norm_quantize(o[r : r + 1], z[r : r + 1], w, div, 1e-6)
        assert torch.equal(q1[0], q[r]) and torch.equal(s1[0], s[r])


_GATED_LAYOUTS = r"""
import sys
import torch
import engine.kernels.decode_quant as dq
from engine.kernels.aot import compile_launch, record

dq.GATED_FORM = sys.argv[1]
dq.GATED_BLOCK_HEADS, dq.GATED_BLOCK_WARPS = int(sys.argv[2]), int(sys.argv[3])
with record() as launches:
    for hv in (48, 32):  # 27B; 4B and 9B
        o, z = torch.zeros(4, hv, 128), torch.zeros(4, hv * 128)
        dq.gated_norm_quantize(o, z, torch.zeros(128), torch.zeros(hv * 128), 1e-6, backend="triton")
for launch in launches:
    compile_launch(launch)
"""


@pytest.mark.slow
def test_gated_norm_forms_sum_in_one_layout(tmp_path) -> None:  # noqa: ANN001
    """Compiled for sm_90 (no GPU needed) at the released head counts, the padded form and the
    blocks form at its default and at 8 heads on 2 warps sum each head's squares over tiles laid
    out alike along the head (the same values a thread and lanes a head, one warp a head), so on
    the GPU too they sum in one order: the same bits (`test_gated_norm_blocks_give_the_padded_bits`
    checks them there). 8 heads on 8 warps holds 4 values a thread: another order."""
    pytest.importorskip("triton.backends.nvidia")
    import re

    import engine.kernels.decode_quant as dq
    from tests.engine.kernels.layouts import compile_script, sum_layouts

    def along_head(layout: str) -> tuple[str, ...]:
        """The layout's parameters along the head (dim 1, the reduced one), and its order."""
        found = [
            re.search(rf"{key} = \[\d+, (\d+)\]", layout)
            for key in ("sizePerThread", "threadsPerWarp", "warpsPerCTA")
        ]
        order = re.search(r"order = \[\d+, \d+\]", layout)
        assert all(found) and order, layout
        return (*(m.group(1) for m in found if m), order.group(0))

    settings = {
        "padded": ("padded", dq.GATED_BLOCK_HEADS, dq.GATED_BLOCK_WARPS),
        "blocks": ("blocks", dq.GATED_BLOCK_HEADS, dq.GATED_BLOCK_WARPS),
        "blocks 8x2": ("blocks", 8, 2),
        "blocks 8x8": ("blocks", 8, 8),
    }
    got = {}
    for name, (form, heads, warps) in settings.items():
        cache = tmp_path / name.replace(" ", "_")
        compile_script(_GATED_LAYOUTS, [form, str(heads), str(warps)], cache)
        sums = [(shape, layout) for _, shape, layout in sum_layouts(cache)]
        assert sums and all(shape.endswith("x128xf32") for shape, _ in sums), sums
        got[name] = {along_head(layout) for _, layout in sums}
    assert len(got["padded"]) == 1, got  # one layout along the head at both head counts
    assert got["blocks"] == got["padded"] and got["blocks 8x2"] == got["padded"], got
    ((size, lanes, warps_along, _),) = got["padded"]
    assert int(size) * int(lanes) == 128 and warps_along == "1", got  # a head inside one warp
    assert got["blocks 8x8"] != got["padded"], got


# The resident kernel with its loads kept in order (RESIDENT_ORDERED) and the recompute split
# (RECOMPUTE_*), at the knob settings bench_rows.py times: (K, settings); every one must give the
# default's bits. K = 3,272 = 3 x 1,024 + 200 (ragged last block; 7 blocks of 512, 2 of 2,048);
# 1,003 is no multiple of 4 (the ordered form's [BLOCK / 4, 4] blocks end mid-row).
_ORDERED = dict(RESIDENT_ORDERED=True, SPLIT_MAX_ROWS=0)
_RECOMPUTE = dict(RECOMPUTE_ROWS=(1, 1 << 30))
_NEW_SWIGLU_SETTINGS = [
    (3272, dict(_ORDERED, RESIDENT_AHEAD=0)),
    (3272, dict(_ORDERED, RESIDENT_AHEAD=2, RESIDENT_MAXNREG=128)),
    (3272, dict(_ORDERED, RESIDENT_AHEAD=4)),  # AHEAD >= the 4 blocks: all loaded up front
    (3272, dict(_ORDERED, RESIDENT_BLOCK=512, RESIDENT_WARPS=4, RESIDENT_AHEAD=2, RESIDENT_MAXNREG=168)),
    (3272, dict(_ORDERED, RESIDENT_BLOCK=2048, RESIDENT_WARPS=16, RESIDENT_AHEAD=1, RESIDENT_MAXNREG=64)),
    (1003, dict(_ORDERED, RESIDENT_BLOCK=256, RESIDENT_WARPS=2, RESIDENT_AHEAD=1)),  # last block ragged
    (3272, dict(RESIDENT_BLOCK=512, RESIDENT_WARPS=4, RESIDENT_VALUES=136, SPLIT_MAX_ROWS=0)),  # unordered
    (3272, dict(_RECOMPUTE, RECOMPUTE_CHUNK=1024, RECOMPUTE_WARPS=4)),
    (3272, dict(_RECOMPUTE, RECOMPUTE_CHUNK=512, RECOMPUTE_WARPS=4, RECOMPUTE_L2_HINTS=False)),
    (3272, dict(_RECOMPUTE, RECOMPUTE_CHUNK=2048, RECOMPUTE_WARPS=8, RECOMPUTE_REVERSE=False)),
    (3272, dict(_RECOMPUTE, RECOMPUTE_CHUNK=4096, RECOMPUTE_WARPS=8)),  # one chunk longer than the row
    (1003, dict(_RECOMPUTE, RECOMPUTE_CHUNK=256, RECOMPUTE_WARPS=2)),
]


@pytest.mark.parametrize(
    ("k", "setting"),
    [
        (300, dict(RESIDENT_BLOCK=2048, RESIDENT_WARPS=16, RESIDENT_AHEAD=2)),
        (5000, dict(RESIDENT_BLOCK=1024, RESIDENT_WARPS=8, RESIDENT_AHEAD=2)),
        (5000, dict(RESIDENT_BLOCK=2048, RESIDENT_WARPS=16, RESIDENT_AHEAD=9)),
        (17408, dict(RESIDENT_BLOCK=4096, RESIDENT_WARPS=32, RESIDENT_AHEAD=1)),
        (17408, dict(RESIDENT_VALUES=0)),  # the 27B row through the long-row kernel
        (18500, dict(RESIDENT_VALUES=80)),  # past 72 a thread (long-row by default) held in registers
        # the split form (a row in chunks, two launches) and, whatever the default, the one-program
        # kernels: 17,408 in 9 chunks of 2,048 (the last ragged), 300 in 3 of 128, 5,000 in 5
        (17408, dict(SPLIT_MAX_ROWS=64, SPLIT_CHUNK=2048)),
        (300, dict(SPLIT_MAX_ROWS=64, SPLIT_CHUNK=128, SPLIT_WARPS=1)),
        (5000, dict(SPLIT_MAX_ROWS=64, SPLIT_CHUNK=1024, SPLIT_WARPS=8)),
        (17408, dict(SPLIT_MAX_ROWS=0)),
        *_NEW_SWIGLU_SETTINGS,
    ],
)
def test_swiglu_bits_do_not_depend_on_the_kernel_or_its_config(
    dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, k: int, setting: dict
) -> None:
    """SwiGLU + quantization under another block, warp count, loads ahead or kernel (row held
    in registers, read twice, or cut into chunks over two launches) gives the default's bits,
    which agree with the torch reference to rounding (silu's exp is not torch's); the
    interleaved gate_up is a column slice of a wider GEMM output (rows strided past 2K), and a
    zero row and a row alone are in the checks."""
    import engine.kernels.decode_quant as dq

    b = 64 if dev.type == "cuda" else 3
    stacked = (torch.randn(b, 2 * k + 8, generator=gen) * 3).to(dev)
    gate_up = stacked[:, 4 : 4 + 2 * k]
    stacked[1] = 0.0
    sdiv = torch.rand(k, generator=gen).to(dev) + 0.5
    for divisor in (None, sdiv):
        q_def, s_def = swiglu_quantize(gate_up, divisor)
        with monkeypatch.context() as patch:
            for name, value in setting.items():
                patch.setattr(dq, name, value)
            q_new, s_new = swiglu_quantize(gate_up, divisor)
            q_one, s_one = swiglu_quantize(gate_up[b - 1 :], divisor)
        assert torch.equal(s_new, s_def) and torch.equal(q_new, q_def)
        assert s_new[1] == 0 and not q_new[1].any()
        assert torch.equal(q_one[0], q_new[b - 1]) and torch.equal(s_one[0], s_new[b - 1])
        q_ref, s_ref = swiglu_quantize(gate_up, divisor, backend="torch")
        torch.testing.assert_close(s_def, s_ref, rtol=1e-6, atol=0)
        assert (q_def.int() - q_ref.int()).abs().max() <= 1
        assert (q_def != q_ref).float().mean() < 0.01


def test_long_swiglu_rows_take_the_long_row_kernel() -> None:
    """At the default config (the launches recorded, not run): calls of more than SPLIT_MAX_ROWS
    rows hold rows up to 18,432 (72 values a thread at 1,024 x 8 warps) in registers and read
    longer ones twice; calls of at most SPLIT_MAX_ROWS rows cut every row into chunks (two
    launches, one program per row and chunk)."""
    import engine.kernels.decode_quant as dq
    from engine.kernels.aot import record

    def kernels_of(rows: int, k: int) -> list[tuple[str, tuple[int, ...]]]:
        with record() as launches:
            swiglu_quantize(torch.zeros(rows, 2 * k), None)
        return [(launch.name, launch.grid) for launch in launches]

    rows = dq.SPLIT_MAX_ROWS + 1
    assert kernels_of(rows, 17408) == kernels_of(rows, 18432) == [("_swiglu_resident_kernel", (rows,))]
    assert kernels_of(rows, 18433) == [("_swiglu_long_row_kernel", (rows,))]
    assert dq.SPLIT_MAX_ROWS >= 1
    chunks = -(-17408 // dq.SPLIT_CHUNK)
    for r in (1, dq.SPLIT_MAX_ROWS):
        assert kernels_of(r, 17408) == [
            ("_swiglu_chunk_kernel", (r, chunks)),
            ("_quant_chunk_kernel", (r, chunks)),
        ]


def _swiglu_case(
    b: int, k: int, dev: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The interleaved gate_up [b, 2k] as a column slice of a wider GEMM output (rows strided
    past 2k), row 1 zero, and a SmoothQuant divisor [k]."""
    stacked = (torch.randn(b, 2 * k + 8, generator=gen) * 3).to(dev)
    if b > 1:
        stacked[1] = 0.0
    return stacked[:, 4 : 4 + 2 * k], torch.rand(k, generator=gen).to(dev) + 0.5


@pytest.mark.parametrize(
    "setting",
    [
        dict(_ORDERED, RESIDENT_AHEAD=2, RESIDENT_MAXNREG=128),
        dict(_RECOMPUTE, RECOMPUTE_CHUNK=1024, RECOMPUTE_WARPS=4),
    ],
    ids=["ordered", "recompute"],
)
def test_new_swiglu_forms_rows_alone_equal_rows_in_a_batch(
    dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, setting: dict
) -> None:
    """At 1 and 70 rows (past the decoder's 64: the calls the new forms are for), the new form's
    rows equal the default's bits and the torch reference `quantize_rows_reference(silu(g) * u,
    div)` to rounding (silu's exp is not torch's), and a row alone, or any slice of the batch,
    gives the bits it has in the whole batch."""
    import engine.kernels.decode_quant as dq

    k = 3 * 1024 + 200
    gate_up, sdiv = _swiglu_case(70, k, dev, gen)
    q_def, s_def = swiglu_quantize(gate_up, sdiv)
    q_ref, s_ref = swiglu_quantize(gate_up, sdiv, backend="torch")
    torch.testing.assert_close(s_def, s_ref, rtol=1e-6, atol=0)
    assert (q_def.int() - q_ref.int()).abs().max() <= 1
    assert (q_def != q_ref).float().mean() < 0.01
    with monkeypatch.context() as patch:
        for name, value in setting.items():
            patch.setattr(dq, name, value)
        q_all, s_all = swiglu_quantize(gate_up, sdiv)
        assert torch.equal(q_all, q_def) and torch.equal(s_all, s_def)
        for r in (0, 37, 69):
            q1, s1 = swiglu_quantize(gate_up[r : r + 1], sdiv)
            assert torch.equal(q1[0], q_all[r]) and torch.equal(s1[0], s_all[r]), r
        q_mid, s_mid = swiglu_quantize(gate_up[20:33], sdiv)
        assert torch.equal(q_mid, q_all[20:33]) and torch.equal(s_mid, s_all[20:33])


def test_swiglu_recompute_rows_route_calls_to_the_recompute_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launches recorded, not run: off by default (None), the shipped dispatch; with
    RECOMPUTE_ROWS = (lo, hi) calls of lo..hi rows (inclusive) run its two launches, one program
    per (row, chunk) each, before the split and resident forms are considered."""
    import engine.kernels.decode_quant as dq
    from engine.kernels.aot import record

    def kernels_of(rows: int, k: int = 17408) -> list[tuple[str, tuple[int, ...]]]:
        with record() as launches:
            swiglu_quantize(torch.zeros(rows, 2 * k), torch.zeros(k))
        return [(launch.name, launch.grid) for launch in launches]

    assert dq.RECOMPUTE_ROWS is None  # off: slower than the resident kernel where measured
    monkeypatch.setattr(dq, "RECOMPUTE_ROWS", (65, 1024))
    chunks = -(-17408 // dq.RECOMPUTE_CHUNK)
    for rows in (65, 1024):
        assert kernels_of(rows) == [
            ("_swiglu_chunk_absmax_kernel", (rows * chunks,)),
            ("_swiglu_chunk_codes_kernel", (rows * chunks,)),
        ]
    split = ["_swiglu_chunk_kernel", "_quant_chunk_kernel"]
    assert [name for name, _ in kernels_of(dq.SPLIT_MAX_ROWS)] == split
    assert kernels_of(1025) == [("_swiglu_resident_kernel", (1025,))]


@pytest.mark.parametrize(
    "setting",
    [
        dict(),  # 3 rows: the split form
        dict(SPLIT_MAX_ROWS=0),  # the resident kernel, ordered
        dict(SPLIT_MAX_ROWS=0, RESIDENT_ORDERED=False),
        dict(SPLIT_MAX_ROWS=0, RESIDENT_VALUES=0),  # the long-row kernel
        dict(_RECOMPUTE, RECOMPUTE_CHUNK=512),
    ],
    ids=["split", "ordered", "unordered", "long-row", "recompute"],
)
def test_swiglu_strided_gate_up_gives_the_contiguous_bits(
    dev: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, setting: dict
) -> None:
    """Every form reads gate_up through one row pointer and stride: a column slice of a wider
    output (row stride past 2K), a transposed (column-major) tensor and an every-other-column
    view give the bits of their contiguous copy."""
    import engine.kernels.decode_quant as dq

    b, k = 3, 1500
    for name, value in setting.items():
        monkeypatch.setattr(dq, name, value)
    wide = (torch.randn(b, 2 * k + 24, generator=gen) * 3).to(dev)
    views = [
        wide[:, 8 : 8 + 2 * k],
        (torch.randn(2 * k, b, generator=gen) * 3).to(dev).t(),
        (torch.randn(b, 4 * k, generator=gen) * 3).to(dev)[:, 1::2],
    ]
    assert views[0].stride(0) > 2 * k and views[1].stride(1) != 1 and views[2].stride(1) == 2
    sdiv = torch.rand(k, generator=gen).to(dev) + 0.5
    for view in views:
        for divisor in (None, sdiv):
            q, s = swiglu_quantize(view, divisor)
            q_c, s_c = swiglu_quantize(view.contiguous(), divisor)
            assert torch.equal(q, q_c) and torch.equal(s, s_c)
            q_ref, s_ref = swiglu_quantize(view, divisor, backend="torch")
            torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
            assert (q.int() - q_ref.int()).abs().max() <= 1
            assert (q != q_ref).float().mean() < 0.01


def test_swiglu_rejects_bad_shapes(dev: torch.device) -> None:
    """gate_up must be 2-D with an even column count (pairs), the divisor [K]: ValueError on
    either backend, before anything runs."""
    for backend in ("triton", "torch"):
        for bad in (torch.zeros(2, 7), torch.zeros(14), torch.zeros(2, 2, 14)):
            with pytest.raises(ValueError, match="gate_up must be"):
                swiglu_quantize(bad.to(dev), None, backend=backend)
        for div in (torch.ones(8), torch.ones(14), torch.ones(1, 7)):
            with pytest.raises(ValueError, match="divisor must be"):
                swiglu_quantize(torch.zeros(2, 14).to(dev), div.to(dev), backend=backend)


def test_swiglu_pairs_a_gate_with_its_up_on_a_hand_computed_case(dev: torch.device) -> None:
    """gate_up built as torch.stack((g, u), -1).flatten(1) (gate j at column 2j, up j at 2j + 1)
    against values worked by hand: silu(20) = 20 in fp32 (exp(-20) vanishes beside 1), silu(0) = 0,
    silu(-20) * 3 ~ -1e-7 (code 0), so row 0's v = [100, 0, -40, ~0]: scale 100 / 127, codes
    [127, 0, rint(-50.8), 0]; over the divisor [2, 1, 4, 1], v = [50, 0, -10, ~0]: codes
    [127, 0, rint(-25.4), 0]. Row 1 (gates all 0) is zero whatever its ups. With the roles
    swapped (stack((u, g))) the kernel computes silu(u) * g: checked against math.exp."""
    import math

    g = torch.tensor([[20.0, 0.0, 20.0, -20.0], [0.0, 0.0, 0.0, 0.0]])
    u = torch.tensor([[5.0, 2.0, -2.0, 3.0], [1.0, -4.0, 2.5, 8.0]])
    gate_up = torch.stack((g, u), -1).flatten(1).to(dev)
    assert gate_up[0, :4].tolist() == [20.0, 5.0, 0.0, 2.0]
    cases = [
        (None, [127, 0, -51, 0], torch.tensor(100.0) / 127.0),
        (torch.tensor([2.0, 1.0, 4.0, 1.0]), [127, 0, -25, 0], torch.tensor(50.0) / 127.0),
    ]
    for backend in ("triton", "torch"):
        for div, codes, scale in cases:
            q, s = swiglu_quantize(gate_up, None if div is None else div.to(dev), backend=backend)
            assert q.dtype == torch.int8 and q.shape == (2, 4) and s.shape == (2,)
            assert q.cpu().tolist() == [codes, [0, 0, 0, 0]], (backend, div)
            assert s.cpu().tolist() == [scale.item(), 0.0], (backend, div)
        # roles swapped: silu(u) * g, against a float64 oracle (no code near a rounding boundary)
        q, s = swiglu_quantize(torch.stack((u, g), -1).flatten(1).to(dev), None, backend=backend)
        v = [x / (1.0 + math.exp(-x)) * y for x, y in zip(u[0].tolist(), g[0].tolist(), strict=True)]
        want_scale = max(abs(x) for x in v) / 127.0
        assert q.cpu().tolist() == [[round(x / want_scale) for x in v], [0, 0, 0, 0]], backend
        assert math.isclose(s[0].item(), want_scale, rel_tol=1e-6) and s[1].item() == 0.0


_COMPILE_NEW_FORMS = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
import engine.kernels.decode_quant as dq
from engine.kernels.aot import compile_launch, record

got = {}
for name, values in json.loads(sys.argv[1]).items():
    saved = {n: getattr(dq, n) for n in values}
    for n, v in values.items():
        setattr(dq, n, tuple(v) if isinstance(v, list) else v)
    with record() as launches:
        dq.swiglu_quantize(torch.zeros(256, 2 * 17408), torch.zeros(17408))
    for n, v in saved.items():
        setattr(dq, n, v)
    got[name] = [(l.name, *(lambda c: (c.registers, c.local_bytes))(compile_launch(l))) for l in launches]
print(json.dumps(got))
"""


@pytest.mark.slow
def test_new_swiglu_forms_compile_for_hopper(tmp_path) -> None:  # noqa: ANN001
    """Compiled for sm_90 (no GPU needed) at the 27B row: the ordered resident kernel at AHEAD 2
    compiles within its 128-register cap (two programs of 8 warps an SM, the point of the form),
    and the recompute split's two kernels compile. Whether the cap costs spills is the compiler's
    (none under triton 3.9, 16 bytes under 3.6): a bench question, not a promise."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    repo = Path(__file__).resolve().parents[3]
    forms = {
        "ordered": dict(RESIDENT_ORDERED=True, RESIDENT_AHEAD=2, RESIDENT_MAXNREG=128, SPLIT_MAX_ROWS=0),
        "recompute": dict(RECOMPUTE_ROWS=[1, 1 << 30]),
    }
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_NEW_FORMS, json.dumps(forms)], cwd=repo, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    ((name, regs, _local_bytes),) = got["ordered"]
    assert name == "_swiglu_resident_kernel"
    if regs is not None:  # cuobjdump found
        assert regs <= 128, got
    assert [n for n, *_ in got["recompute"]] == ["_swiglu_chunk_absmax_kernel", "_swiglu_chunk_codes_kernel"]


def test_misaligned_piece_offsets_raise_on_cpu(dev: torch.device, gen: torch.Generator) -> None:
    """The decode attention kernels declare piece offsets multiples of PIECE_ALIGN (16-byte loads
    and stores when compiled): CPU tables are checked, since the interpreter would read a
    misaligned block right anyway."""
    if dev.type == "cuda":
        pytest.skip("CUDA tables are not read back")
    from engine.kernels.decode_attention import PIECE_ALIGN

    pool, x, rows, pieces, heads = _attention_case("tiny", dev, gen)
    assert PIECE_ALIGN > 1 and not bool((pieces[..., :2] % PIECE_ALIGN).any())  # the pool's
    q = attention_prep(x, pool.base, rows, pieces, heads, backend="triton")
    for field in (0, 1):  # k_off, v_off
        bad = pieces.clone()
        bad[1, 0, field] += 2
        with pytest.raises(ValueError, match="multiples of"):
            decode_attention(q, x.qg, pool.base, rows, bad, num_kv_heads=heads.num_kv_heads)
        with pytest.raises(ValueError, match="multiples of"):
            attention_prep(x, pool.base, rows, bad, heads, backend="triton")
