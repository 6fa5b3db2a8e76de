"""Unit tests of the int8 arithmetic (engine.quant.linear) and of calibration (engine.quant.calibration).

Oracles: int64 matrix products, hand-computed SmoothQuant scales, the unsmoothed fp32 model,
and quantities recomputed from the generator's canonical weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.prompt import PromptEncoder
from engine.quant.calibration import (
    activation_stats,
    calibration_segments,
    load_calibration_requests,
    quantize_weights,
    smooth_weights,
    stat_name,
)
from engine.quant.linear import (
    QuantLinear,
    SmoothedLinear,
    fold_smoothing,
    int8_matmul,
    quantize_rows,
    smooth_scales,
)
from engine.run.executor import _spanwise, run_forest
from engine.run.forest import Segment, build_forest
from engine.run.reference import rms_norm
from engine.testing.vocab import qwen35_vocab

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.fixture(scope="module")
def tokenizer_encoder() -> PromptEncoder:
    return PromptEncoder(qwen35_vocab().tokenizer())


def _randint8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int64).to(torch.int8)


# ------------------------------------------------------------------------ quantization
def test_quantize_rows_round_trip_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 200, generator=gen) * torch.logspace(-3, 3, 37)[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert int(q.abs().max()) == 127
    # the absmax element of every row lands exactly on +-127
    assert torch.equal(q.abs().amax(dim=1), torch.full((37,), 127, dtype=torch.int8))
    err = (q.float() * scale[:, None] - x).abs()
    assert bool((err <= scale[:, None] * 0.5 * (1 + 1e-5)).all())


def test_quantize_rows_rounds_half_to_even_and_handles_zero_rows() -> None:
    # scale = 127 / 127 = 1, so x / scale is exactly the value given
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 127.0], [0.0] * 7])
    q, scale = quantize_rows(x)
    assert q[0].tolist() == [0, 2, 2, 0, -2, -2, 127]
    assert scale.tolist() == [1.0, 0.0]
    assert q[1].tolist() == [0] * 7


def test_quantize_rows_is_row_local() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(301, 96, generator=gen)
    q, s = quantize_rows(x)
    for i in (0, 7, 150, 300):
        qi, si = quantize_rows(x[i : i + 1])
        assert torch.equal(qi[0], q[i]) and torch.equal(si[0].view(torch.int32), s[i].view(torch.int32))


# ------------------------------------------------------------------------ integer GEMM
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 64, 128), (3, 64, 4), (17, 72, 9), (40, 13, 128), (257, 512, 32)]
)
def test_int8_matmul_is_exact(device: str, m: int, k: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    a, b = _randint8((m, k), gen), _randint8((n, k), gen)
    want = a.long() @ b.long().T
    # On CPU Prism never calls torch._int_mm (engine.quant.linear.int8_matmul says why): whether that
    # is exact depends on the CPU's oneDNN kernels, so only the paths Prism takes are asserted.
    if device == "cpu":
        impls = ["auto", "float64"]
    else:
        impls = ["auto", "padded", "float64"] + (["int_mm"] if m > 16 and k % 8 == 0 == n % 8 else [])
    for impl in impls:
        got = int8_matmul(a.to(device), b.to(device), impl=impl)  # type: ignore[arg-type]
        assert got.dtype == torch.int32, impl
        assert torch.equal(got.cpu().long(), want), impl


@pytest.mark.parametrize("device", DEVICES)
def test_int8_matmul_extreme_values_do_not_overflow(device: str) -> None:
    k = 4096  # 4096 * 127^2 = 66M, far below 2^31 but above fp32's exact range
    a = torch.full((5, k), -127, dtype=torch.int8)
    b = torch.full((8, k), 127, dtype=torch.int8)
    got = int8_matmul(a.to(device), b.to(device))
    assert torch.equal(got.cpu().long(), torch.full((5, 8), -127 * 127 * k, dtype=torch.long))


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])  # CPU: no _int_mm (see above)
def test_padded_path_equals_direct_path(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = _randint8((64, 96), gen), _randint8((40, 96), gen)
    direct = int8_matmul(a.to(device), b.to(device), impl="int_mm")
    padded = int8_matmul(a.to(device), b.to(device), impl="padded")
    assert torch.equal(direct, padded)
    # rows of a small call equal the same rows of a large one (the padded path is taken for M <= 16)
    small = int8_matmul(a[:5].to(device), b.to(device))
    assert torch.equal(small, direct[:5])


def test_int8_matmul_rejects_bad_operands() -> None:
    with pytest.raises(ValueError, match="int8 operands"):
        int8_matmul(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[M, K\] and \[N, K\]"):
        int8_matmul(torch.zeros(2, 8, dtype=torch.int8), torch.zeros(2, 9, dtype=torch.int8))


# ------------------------------------------------------------------------ QuantLinear
@pytest.mark.parametrize("device", DEVICES)
def test_quant_linear_matches_its_dequantized_float_product(device: str) -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 64, generator=gen)
    s = torch.rand(64, generator=gen) + 0.5
    lin = QuantLinear.from_float(w, smooth=s).to(device)
    x = torch.randn(33, 64, generator=gen).to(device)
    y = lin(x)
    # oracle: the same integer maths done by hand in float64
    xs = x.double().cpu() / s.double()
    q, a_scale = quantize_rows(x.cpu() / s)
    want = (
        (q.double() @ lin.qweight.cpu().double().T) * a_scale.double()[:, None] * lin.w_scale.cpu().double()
    )
    torch.testing.assert_close(y.cpu().double(), want, rtol=1e-6, atol=1e-6)
    # and it approximates the float linear to int8 accuracy
    rel = (y.cpu().double() - xs @ (w.double() * s.double()).T).norm() / (
        xs @ (w.double() * s.double()).T
    ).norm()
    assert rel < 0.02


@pytest.mark.parametrize("device", DEVICES)
def test_quant_linear_rows_do_not_depend_on_the_batch(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    lin = QuantLinear.from_float(torch.randn(4, 64, generator=gen)).to(device)  # N=4: padded on CUDA
    x = torch.randn(301, 64, generator=gen).to(device)
    full = lin(x).view(torch.int32)
    for lo, hi in [(0, 1), (5, 6), (17, 50), (299, 301), (0, 17)]:
        assert torch.equal(lin(x[lo:hi]).view(torch.int32), full[lo:hi])


# ------------------------------------------------------------------------ SmoothQuant
def test_smooth_scales_hand_checked() -> None:
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w1 = torch.tensor([[1.0, -4.0, 2.0, 0.0], [0.5, 1.0, -1.0, 0.0]])  # column absmax [1, 4, 2, 0]
    w2 = torch.tensor([[-0.25, 2.0, 3.0, 0.0]])  # column absmax [0.25, 2, 3, 0]
    s = smooth_scales(act, [w1, w2], 0.5)
    assert s is not None
    # s_j = sqrt(max|X_j|) / sqrt(max|W_j|) with max|W_j| over both weights = [1, 4, 3, 0];
    # channel 2 never activated and channel 3 has an all-zero weight column: s = 1
    assert s.tolist() == pytest.approx([2.0, 0.5, 1.0, 1.0], rel=1e-6)
    s75 = smooth_scales(act, [w1], 0.75)
    assert s75 is not None
    assert s75[0].item() == pytest.approx(4.0**0.75 / 1.0**0.25, rel=1e-6)
    assert s75[1].item() == pytest.approx(1.0**0.75 / 4.0**0.25, rel=1e-6)
    assert smooth_scales(act, [w1], 0.0) is None
    with pytest.raises(ValueError, match="alpha"):
        smooth_scales(act, [w1], 1.5)


def test_smoothing_equalizes_channel_ranges() -> None:
    # With alpha = 0.5, max|X_j / s_j| = max|W_j * s_j| = sqrt(max|X_j| max|W_j|) for every j.
    gen = torch.Generator().manual_seed(6)
    act = torch.rand(32, generator=gen) * 50 + 0.1
    w = torch.randn(16, 32, generator=gen)
    s = smooth_scales(act, [w], 0.5)
    assert s is not None
    torch.testing.assert_close(act / s, (w * s).abs().amax(0), rtol=1e-5, atol=0)


def test_fold_smoothing_keeps_the_norm_linear_product() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 32, generator=gen)
    norm, w = torch.rand(32, generator=gen) + 0.5, torch.randn(8, 32, generator=gen)
    s = torch.rand(32, generator=gen) * 10 + 0.1
    norm_f, (w_f,) = fold_smoothing(norm, [w], s)
    want = rms_norm(x, norm, 1e-6) @ w.T
    torch.testing.assert_close(rms_norm(x, norm_f, 1e-6) @ w_f.T, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(SmoothedLinear(w * s, s)(x), x @ w.T, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ calibration
def _small_forest(n_questions: int = 3) -> list[Segment]:
    gen = torch.Generator().manual_seed(8)

    def toks(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, 20000, (n,), generator=gen).tolist())

    segs = [Segment(toks(11), None)]
    for e in range(3):
        segs.append(Segment(toks(9 + 4 * e), 0))
        ev = len(segs) - 1
        segs.extend(Segment(toks(5 + q), ev, read=True) for q in range(n_questions))
    return segs


def test_calibration_prompts_are_shipped_and_render(tokenizer_encoder: PromptEncoder) -> None:
    requests = load_calibration_requests()
    assert 16 <= len(requests) <= 32
    segments = calibration_segments(tokenizer_encoder, requests)
    reads = [s for s in segments if s.read]
    assert len(reads) == sum(len(r.questions) for r in requests)
    # every question prompt ends with the empty think block the letters are read after
    tail = tuple(tokenizer_encoder.question_tail_ids(False))
    assert all(s.tokens[-len(tail) :] == tail for s in reads)


def test_activation_stats_layer0_equals_the_normed_embeddings(canonical_weights) -> None:  # noqa: ANN001
    w = canonical_weights("tiny", 0, 4)
    segs = _small_forest()
    stats = activation_stats(w, segs)
    tokens = torch.tensor([t for s in segs for t in s.tokens])
    x0 = rms_norm(w.token_embd[tokens], w.layers[0]["attn_norm"], w.config.rms_norm_eps)
    want = x0.abs().amax(0)
    for key in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta"):
        assert torch.equal(stats[stat_name(0, key)], want), key
    # the LM head saw the read positions only: one row per question
    assert stats["output"].shape == (w.config.hidden_size,)


def test_planted_outliers_dominate_the_activation_stats(canonical_weights) -> None:  # noqa: ANN001
    """`make_model --outliers N` creates channels 20-50x larger at the norm-fed linears' inputs."""
    plain, spiky = canonical_weights("tiny", 0, 0), canonical_weights("tiny", 0, 4)
    planted = torch.nonzero(plain.layers[0]["attn_norm"] != spiky.layers[0]["attn_norm"]).flatten()
    assert planted.numel() == 4
    stats = activation_stats(spiky, _small_forest())
    for i in range(spiky.config.num_layers):
        for key in ("attn_norm", "post_attention_norm"):
            feed = "attn_q" if key == "attn_norm" and spiky.config.is_full_attention(i) else None
            name = feed or ("attn_qkv" if key == "attn_norm" else "ffn_up")
            a = stats[stat_name(i, name)]
            others = torch.ones_like(a, dtype=torch.bool)
            others[planted] = False
            ratio = a[planted].min() / a[others].median()
            assert ratio > 10, (i, key, float(ratio))


def test_smoothed_fp32_model_equals_the_original(canonical_weights) -> None:  # noqa: ANN001
    """Folding s into norms and weights (and x / s elsewhere) changes nothing in exact maths."""
    w = canonical_weights("tiny", 0, 4)
    segs = _small_forest()
    stats = activation_stats(w, segs)
    forest = build_forest(segs)
    want = run_forest(w, forest).logits
    for alpha in (0.5, 0.8):
        got = run_forest(smooth_weights(w, stats, alpha), forest).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_quantized_model_tracks_fp32_and_smoothing_helps_with_outliers(canonical_weights) -> None:  # noqa: ANN001
    w = canonical_weights("tiny", 0, 4)
    segs = _small_forest()
    stats = activation_stats(w, segs)
    forest = build_forest(segs)
    want = run_forest(w, forest).logits
    errors = {}
    for alpha in (0.0, 0.5):
        q = quantize_weights(w, stats, alpha)
        assert isinstance(q.output, QuantLinear)
        assert all(isinstance(q.layers[i][k], QuantLinear) for i in range(4) for k in ("ffn_up", "ffn_down"))
        got = run_forest(q, forest).logits
        errors[alpha] = float((got - want).norm() / want.norm())
    assert errors[0.5] < errors[0.0]
    assert errors[0.5] < 0.05


def test_quantize_weights_leaves_the_float_weights_alone(canonical_weights) -> None:  # noqa: ANN001
    w = canonical_weights("small", 0, 0)  # tied embeddings: the LM head must not rescale the embedding
    before = w.token_embd.clone(), w.layers[0]["attn_norm"].clone()
    stats = {name: torch.ones(t.shape[0]) for name, t in _fake_stats_shapes(w).items()}
    q = quantize_weights(w, stats, 0.5)
    assert torch.equal(w.token_embd, before[0]) and torch.equal(w.layers[0]["attn_norm"], before[1])
    assert q.token_embd is w.token_embd
    assert not torch.equal(q.layers[0]["attn_norm"], w.layers[0]["attn_norm"])


def _fake_stats_shapes(w) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from engine.quant.calibration import LM_HEAD, _linear_keys

    out = {LM_HEAD: torch.empty(w.config.hidden_size)}
    for i, layer in enumerate(w.layers):
        for key in _linear_keys(w, i):
            out[stat_name(i, key)] = torch.empty(layer[key].shape[1])
    return out


# ------------------------------------------------------------------------ segment-wise float ops
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [torch.sigmoid, F.silu, F.softplus, torch.exp], ids=lambda f: f.__name__)
def test_spanwise_ops_do_not_depend_on_the_batch(device: str, fn) -> None:  # noqa: ANN001
    """A segment's rows computed inside a large, oddly sized level equal the segment computed alone.

    Level tensors here exceed 32768 elements (CPU parallel_for grain) and the spans have odd
    lengths, so vector bodies, scalar tails and thread chunks all fall at different places.
    """
    gen = torch.Generator().manual_seed(9)
    lengths = [1, 7, 33, 7001, 3, 2047, 11]
    x = (torch.randn(sum(lengths), 4, generator=gen) * 4).to(device)
    bounds = [0, *torch.cumsum(torch.tensor(lengths), 0).tolist()]
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    level = _spanwise(fn, spans, x)
    assert x.numel() > 32768
    for lo, hi in spans:
        alone = _spanwise(fn, [(0, hi - lo)], x[lo:hi].clone())
        assert torch.equal(level[lo:hi].view(torch.int32), alone.view(torch.int32))
