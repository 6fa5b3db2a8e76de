"""Linears that read one input, stacked into one GEMM (`engine.run.int8_rows.input_group`): the
outputs are the separate linears' bits, the stacked weight is the only copy, and a replaced
or unstackable linear is noticed. The oracle is the separate linears' own projections."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.decode_quant import swiglu_quantize
from engine.quant.linear import QuantLinear
from engine.run.int8_rows import (
    MLP_INPUTS,
    grouped_projections,
    input_group,
    mlp_residual,
    projections,
    split_projections,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("attn_q", "attn_k", "attn_v")
K = 96


def _linear(g: torch.Generator, n: int, smooth: torch.Tensor | None = None) -> QuantLinear:
    q = torch.randint(-127, 128, (n, K), dtype=torch.int8, generator=g)
    return QuantLinear(q.to(DEVICE), (torch.rand(n, generator=g) * 0.01 + 1e-3).to(DEVICE), smooth)


def _clone(lin: QuantLinear) -> QuantLinear:
    return QuantLinear(lin.qweight.clone(), lin.w_scale.clone(), lin.smooth)


@pytest.fixture
def case() -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    layer = {"attn_q": _linear(g, 40), "attn_k": _linear(g, 8), "attn_v": _linear(g, 8)}
    x = torch.randn(5, K, generator=g).to(DEVICE)
    norm = (torch.rand(K, generator=g) + 0.5).to(DEVICE)
    return layer, x, norm


def test_stacked_outputs_equal_the_separate_linears_bit_for_bit(case) -> None:
    layer, x, norm = case
    separate = projections(x, norm, 1e-6, [_clone(layer[n]) for n in NAMES])
    grouped = grouped_projections(x, norm, 1e-6, layer, NAMES)
    assert [t.shape for t in grouped] == [t.shape for t in separate]
    for got, want in zip(grouped, separate, strict=True):
        assert torch.equal(got, want)
    # each row alone: the same bits as inside the batch of five
    for r in range(x.shape[0]):
        alone = grouped_projections(x[r : r + 1], norm, 1e-6, layer, NAMES)
        for got, want in zip(alone, grouped, strict=True):
            assert torch.equal(got[0], want[r])


def test_the_stacked_weight_is_the_only_copy_and_a_replaced_linear_is_restacked(case) -> None:
    layer, x, norm = case
    group = input_group(layer, NAMES)
    assert group is not None and group.splits == (40, 8, 8)
    storage = group.linear.qweight.untyped_storage().data_ptr()
    assert all(layer[n].qweight.untyped_storage().data_ptr() == storage for n in NAMES)
    assert input_group(layer, NAMES) is group  # made once
    g = torch.Generator().manual_seed(1)
    layer["attn_k"] = _linear(g, 8)  # e.g. a reloaded entry
    fresh = input_group(layer, NAMES)
    assert fresh is not None and fresh is not group
    separate = projections(x, norm, 1e-6, [_clone(layer[n]) for n in NAMES])
    for got, want in zip(grouped_projections(x, norm, 1e-6, layer, NAMES), separate, strict=True):
        assert torch.equal(got, want)


def test_linears_with_different_smoothquant_divisors_stay_separate(case) -> None:
    layer, x, norm = case
    g = torch.Generator().manual_seed(2)
    layer["attn_v"] = _linear(g, 8, smooth=(torch.rand(K, generator=g) + 0.5).to(DEVICE))
    assert input_group(layer, NAMES) is None
    separate = projections(x, norm, 1e-6, [_clone(layer[n]) for n in NAMES])
    for got, want in zip(grouped_projections(x, norm, 1e-6, layer, NAMES), separate, strict=True):
        assert torch.equal(got, want)


GDN_NAMES = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")


@pytest.mark.parametrize("smooth", [False, True], ids=["stacked", "separate"])
@pytest.mark.parametrize(
    ("names", "at_reads"),
    [(NAMES, {"attn_q"}), (GDN_NAMES, {"attn_gate"}), (GDN_NAMES, {"attn_qkv", "ssm_alpha"}), (NAMES, set())],
)
def test_split_projections_give_the_grouped_bits_at_their_rows(
    names: tuple[str, ...], at_reads: set[str], smooth: bool
) -> None:
    """The last layer's projections (`split_projections`): a linear wanted at the read rows gives
    exactly those rows of `grouped_projections`, the others every row's bits - whether the group
    stacks (runs of members as one GEMM each: a run in the middle, runs at both ends) or not (a
    SmoothQuant divisor of its own)."""
    g = torch.Generator().manual_seed(5)
    layer = {n: _linear(g, w) for n, w in zip(names, (40, 24, 8, 8), strict=False)}
    if smooth:
        layer[names[-1]] = _linear(g, 8, smooth=(torch.rand(K, generator=g) + 0.5).to(DEVICE))
    x = torch.randn(7, K, generator=g).to(DEVICE)
    norm = (torch.rand(K, generator=g) + 0.5).to(DEVICE)
    reads = torch.tensor([6, 0, 3, 3], device=DEVICE)  # any order, a row twice (padding reads)
    want = grouped_projections(x, norm, 1e-6, layer, names)
    got = split_projections(x, norm, 1e-6, layer, names, reads, frozenset(at_reads))
    assert (input_group(layer, names) is None) == smooth
    for name, a, b in zip(names, got, want, strict=True):
        assert torch.equal(a, b.index_select(0, reads) if name in at_reads else b), name


def _mlp_layer(inter: int, hidden: int, smooth: bool, seed: int = 4) -> dict:
    """An MLP's linears: gate and up [I, K] (one shape), down [K, I] with ffn_down's divisor or none."""
    gen = torch.Generator().manual_seed(seed)
    div = (torch.rand(inter, generator=gen) + 0.5).to(DEVICE) if smooth else None
    down = torch.randint(-127, 128, (hidden, inter), dtype=torch.int8, generator=gen).to(DEVICE)
    return {
        "ffn_gate": _linear(gen, inter),
        "ffn_up": _linear(gen, inter),
        "ffn_down": QuantLinear(down, (torch.rand(hidden, generator=gen) * 0.01 + 1e-3).to(DEVICE), div),
        "post_attention_norm": (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE),
    }


def test_the_mlps_gate_and_up_are_stored_interleaved_as_the_only_copy() -> None:
    """The MLP's group stacks gate and up interleaved (row 2j gate j, row 2j + 1 up j), its weight
    the only copy: the layer's entries become its even and odd rows (views) and equal the linears
    they replace; the group's outputs are the separate linears' bits, at every row alone too, and
    `split_projections` picks the read rows of the one GEMM."""
    layer = _mlp_layer(48, K, smooth=False)
    before = [_clone(layer[n]) for n in MLP_INPUTS]
    group = input_group(layer, MLP_INPUTS)
    assert group is not None and group.interleaved and group.splits == (48, 48)
    storage = group.linear.qweight.untyped_storage().data_ptr()
    for i, (name, old) in enumerate(zip(MLP_INPUTS, before, strict=True)):
        assert layer[name].qweight.untyped_storage().data_ptr() == storage
        assert torch.equal(layer[name].qweight, old.qweight) and torch.equal(layer[name].w_scale, old.w_scale)
        assert torch.equal(group.linear.qweight[i::2], old.qweight)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, K, generator=g).to(DEVICE)
    norm = layer["post_attention_norm"]
    separate = projections(x, norm, 1e-6, before)
    grouped = grouped_projections(x, norm, 1e-6, layer, MLP_INPUTS)
    for got, want in zip(grouped, separate, strict=True):
        assert torch.equal(got, want)
    for r in range(x.shape[0]):
        for got, want in zip(
            grouped_projections(x[r : r + 1], norm, 1e-6, layer, MLP_INPUTS), separate, strict=True
        ):
            assert torch.equal(got[0], want[r])
    reads = torch.tensor([4, 0, 0], device=DEVICE)
    for at_reads in ({"ffn_gate"}, {"ffn_up"}, set(MLP_INPUTS), set()):
        got = split_projections(x, norm, 1e-6, layer, MLP_INPUTS, reads, frozenset(at_reads))
        for name, a, b in zip(MLP_INPUTS, got, separate, strict=True):
            assert torch.equal(a, b.index_select(0, reads) if name in at_reads else b), (name, at_reads)


def test_gate_and_up_of_different_shapes_are_not_interleaved() -> None:
    layer = _mlp_layer(48, K, smooth=False)
    layer["ffn_up"] = _linear(torch.Generator().manual_seed(7), 40)
    assert input_group(layer, MLP_INPUTS) is None


@pytest.mark.parametrize("smooth", [False, True])
def test_mlp_residual_equals_the_separate_linears_swiglu(smooth: bool) -> None:
    """`mlp_residual` over the interleaved group equals the MLP computed from the separate gate and
    up linears (their own GEMMs, paired by hand for the quantizer), then ffn_down with the residual,
    bit for bit; each row alone too."""
    from engine.run.int8_rows import gemm

    layer = _mlp_layer(48, K, smooth)
    gate, up, down = (_clone(layer[n]) for n in (*MLP_INPUTS, "ffn_down"))
    h = (torch.randn(6, K, generator=torch.Generator().manual_seed(8)) * 2).to(DEVICE)
    g_out, u_out = projections(h, layer["post_attention_norm"], 1e-6, [gate, up])
    pairs = torch.empty(h.shape[0], 2 * g_out.shape[1], device=DEVICE)
    pairs[:, 0::2], pairs[:, 1::2] = g_out, u_out
    want = gemm(*swiglu_quantize(pairs, down.smooth), down, residual=h)
    got = mlp_residual(h, layer, 1e-6)
    assert input_group(layer, MLP_INPUTS) is not None
    assert torch.equal(got, want)
    for r in range(h.shape[0]):
        assert torch.equal(mlp_residual(h[r : r + 1], layer, 1e-6)[0], want[r])


def test_mlp_residual_without_a_stacked_group_pairs_the_separate_outputs() -> None:
    """Gate and up with SmoothQuant divisors of their own cannot share one GEMM (no group): the MLP
    then multiplies each and pairs their outputs for the quantizer, with the separate linears' bits
    (the oracle: their own projections, each through its own divisor, paired by hand)."""
    layer = _mlp_layer(48, K, smooth=True)
    gen = torch.Generator().manual_seed(9)
    for name in MLP_INPUTS:
        layer[name] = _linear(gen, 48, smooth=(torch.rand(K, generator=gen) + 0.5).to(DEVICE))
    assert input_group(layer, MLP_INPUTS) is None
    h = (torch.randn(4, K, generator=gen) * 2).to(DEVICE)
    norm, down = layer["post_attention_norm"], layer["ffn_down"]
    (g_out,), (u_out,) = (projections(h, norm, 1e-6, [layer[n]]) for n in MLP_INPUTS)
    pairs = torch.empty(h.shape[0], 2 * g_out.shape[1], device=DEVICE)
    pairs[:, 0::2], pairs[:, 1::2] = g_out, u_out
    from engine.run.int8_rows import gemm

    want = gemm(*swiglu_quantize(pairs, down.smooth), down, residual=h)
    assert torch.equal(mlp_residual(h, layer, 1e-6), want)


def test_the_level_executors_mlp_reads_the_stored_group_with_the_separate_bits() -> None:
    """Once a body stored gate and up interleaved, the level executor (image evidence) multiplies the
    stored weight once and takes its even and odd columns: the same bits as the separate linears,
    whole-batch and segment by segment."""
    from engine.run.executor import _mlp

    separate = _mlp_layer(48, K, smooth=True)
    grouped = dict(separate)
    assert input_group(grouped, MLP_INPUTS) is not None
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    for spans in (None, [(0, 3), (3, 7)]):
        assert torch.equal(_mlp(grouped, x, spans), _mlp(separate, x, spans))


@pytest.mark.skipif(DEVICE != "cuda", reason="the fused SwiGLU GEMM runs on CUDA only (mlp_residual)")
@pytest.mark.parametrize("rows", [1, 5, 16, 100, 700])
@pytest.mark.parametrize("smooth", [False, True])
def test_mlp_residual_fused_swiglu_equals_the_unfused_path(
    monkeypatch: pytest.MonkeyPatch, rows: int, smooth: bool
) -> None:
    """`mlp_residual` with the gate+up GEMM's SwiGLU epilogue - Triton's fused kernel, or on Hopper
    with the CUTLASS library its one-GEMM form (`cutlass_gemm.SWIGLU_MIN_ROWS`) where it serves M - gives
    the unfused path's bits, at each M bucket (M = 1 and 5-16 cross the table's lines), whichever
    form the engine picks there (`swiglu_fused`)."""
    from engine import kernels
    from engine.kernels import cutlass_gemm

    inter = 320
    h = (torch.randn(rows, K, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE)
    default = mlp_residual(h, _mlp_layer(inter, K, smooth), 1e-6)
    monkeypatch.setattr(kernels, "swiglu_fused", lambda m, w: False)
    unfused = mlp_residual(h, _mlp_layer(inter, K, smooth), 1e-6)
    monkeypatch.setattr(kernels, "swiglu_fused", lambda m, w: True)
    triton_fused = mlp_residual(h, _mlp_layer(inter, K, smooth), 1e-6)
    monkeypatch.setattr(cutlass_gemm, "SWIGLU_MIN_ROWS", 0)
    one_gemm = mlp_residual(h, _mlp_layer(inter, K, smooth), 1e-6)
    for got in (default, triton_fused, one_gemm):
        assert torch.equal(got, unfused)
