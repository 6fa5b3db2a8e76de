"""Row quantization kernels: bit-equal to torch (plain), ~1 ulp (fused norm), batch invariant;
rows that fit in registers and longer rows (two kernels) alike, and with the same bits."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.quant import (
    quantize_rows,
    quantize_rows_reference,
    rms_norm_fp32,
    rms_norm_quantize,
    rms_norm_quantize_reference,
)

ON_CUDA = torch.cuda.is_available()
EPS = 1e-6


def _rows(gen: torch.Generator, m: int, k: int, dev: torch.device, dtype: torch.dtype = torch.float32):
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    x[:, ::17] *= 20  # outlier channels, as SmoothQuant sees them
    return x.to(dtype).to(dev)


def test_reference_rounds_half_to_even_and_clamps() -> None:
    # absmax 127 -> scale exactly 1, so x / scale hits exact .5 ties
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -126.5]])
    q, scale = quantize_rows_reference(x)
    assert scale.tolist() == [1.0]
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 3, -126]]
    q0, s0 = quantize_rows_reference(torch.zeros(2, 8))
    assert s0.tolist() == [0.0, 0.0] and not q0.any()


def test_reference_reconstructs_within_half_a_step(gen: torch.Generator) -> None:
    x = _rows(gen, 6, 96, torch.device("cpu"))
    q, scale = quantize_rows_reference(x)
    assert torch.all((q.float() * scale[:, None] - x).abs() <= scale[:, None] * 0.5 * (1 + 1e-5))
    assert torch.all(q.abs().amax(-1) == 127)


# 5000: five blocks held in registers; 16,500: past 16,384, the long-row kernel's four full
# 4,096 blocks and a ragged fifth
@pytest.mark.parametrize("k", [40, 5000, 16500])
@pytest.mark.parametrize("with_divisor", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_kernel_equals_reference(
    gen: torch.Generator, dev: torch.device, k: int, with_divisor: bool, dtype: torch.dtype
) -> None:
    # on CUDA enough rows that a 1-ulp scale difference (as torch's division by a Python
    # scalar gives there) would show; the interpreter keeps it small
    x = _rows(gen, 512 if ON_CUDA else 5, k, dev, dtype)
    x[1, :9] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -4.5], dtype=dtype)
    x[1, 9:] = 0.25  # row 1: absmax 127, exact ties
    x[3] = 0.0  # an all-zero row
    div = (torch.rand(k, generator=gen) + 0.5).to(dev) if with_divisor else None
    if with_divisor:
        div[:9] = 1.0
    q, scale = quantize_rows(x, div, backend="triton")
    q_ref, s_ref = quantize_rows_reference(x, div)
    assert torch.equal(scale, s_ref)
    assert torch.equal(q, q_ref)


@pytest.mark.parametrize("long_row", [False, True])  # 10,240: past 8,192, the long-row kernel
def test_rms_norm_quantize_close_to_reference(
    gen: torch.Generator, dev: torch.device, long_row: bool
) -> None:
    m, k = (256, 5120) if ON_CUDA else (6, 300)
    k = 10240 if long_row else k
    x = _rows(gen, m, k, dev)
    w = (torch.rand(k, generator=gen) + 0.5).to(dev)
    q, scale = rms_norm_quantize(x, w, EPS, backend="triton")
    q_ref, s_ref = rms_norm_quantize_reference(x, w, EPS)
    assert torch.allclose(scale, s_ref, rtol=1e-6, atol=0)
    # the norm's sum of squares is reduced in another order: values agree to ~1 ulp, so a
    # quantized value may sit on the other side of a rounding boundary, never further
    assert int((q.int() - q_ref.int()).abs().max()) <= 1
    assert (q == q_ref).float().mean().item() >= 0.999
    # and against an fp64 oracle of the normed values
    normed = rms_norm_fp32(x.double(), w.double(), EPS)
    assert torch.all((q.double() * scale[:, None].double() - normed).abs() <= scale[:, None] * 0.5 + 1e-5)


@pytest.mark.parametrize("long_row", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_rows_do_not_depend_on_batch(
    gen: torch.Generator, dev: torch.device, fused: bool, long_row: bool
) -> None:
    m, k = (1000, 5120) if ON_CUDA else (9, 300)
    if long_row:  # past the resident kernel's registers: the long-row kernel
        m, k = min(m, 64), 10240 if fused else 16500
    x = _rows(gen, m, k, dev)
    w = (torch.rand(k, generator=gen) + 0.5).to(dev)

    def run(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if fused:
            return rms_norm_quantize(rows, w, EPS, backend="triton")
        return quantize_rows(rows, w, backend="triton")

    q_all, s_all = run(x)
    for lo, hi in [(0, 1), (2, 5), (m - 3, m)]:
        q, s = run(x[lo:hi].clone())
        assert torch.equal(q, q_all[lo:hi]) and torch.equal(s, s_all[lo:hi])


def test_bad_inputs_are_named(dev: torch.device) -> None:
    x = torch.ones(3, 8, device=dev)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        quantize_rows(x[0])
    with pytest.raises(ValueError, match="per-channel vector"):
        quantize_rows(x, torch.ones(7, device=dev))
    with pytest.raises(ValueError, match="float32/bfloat16"):
        quantize_rows(x.int())
    with pytest.raises(ValueError, match="eps"):
        rms_norm_quantize(x, torch.ones(8, device=dev), 0.0)


# ------------------------------------------------------------------ resident and long-row kernels
@pytest.mark.parametrize("k", [40, 300, 2560, 5000, 6144, 10240])  # one block .. three of 4,096, ragged ends
@pytest.mark.parametrize("mode", ["plain", "divisor", "norm"])
def test_resident_and_long_row_kernels_give_the_same_bits(
    gen: torch.Generator, dev: torch.device, monkeypatch: pytest.MonkeyPatch, k: int, mode: str
) -> None:
    """A row held in registers and a row read once per pass give the same bits, whichever
    kernel its length picks by default: the plain quantizers (both equal to the torch
    reference too), and the fused norm, whose sum of squares must be reduced in the same
    order (the torch reference only bounds it to ~1 ulp)."""
    import engine.kernels.quant as kq

    m = 64 if ON_CUDA else 4
    x = _rows(gen, m, k, dev, torch.bfloat16 if k == 300 else torch.float32)
    x[1] = 0.0  # an all-zero row: scale 0, q 0
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -4.5])
    x[2, :9] = ties.to(x.dtype)  # absmax 127: exact ties
    if k > 2 * 4096:  # a lane's squares summed over 3 blocks: only block order gives 1 (normed)
        x[3] = 0.0
        x[3, 0] = 1.0
        x[3, 4096::4096] = 2.0**-12  # 1 + 2^-24 + 2^-24 rounds to 1 in order, else 1 + 2^-23
    vec = (torch.rand(k, generator=gen) + 0.5).to(dev)

    def run(rows: torch.Tensor, resident_values: int) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(kq, "RESIDENT_VALUES", resident_values)
        assert (kq.resident_blocking(k, mode == "norm") is None) == (resident_values == 0)
        if mode == "norm":
            return rms_norm_quantize(rows, vec, EPS, backend="triton")
        return quantize_rows(rows, vec if mode == "divisor" else None, backend="triton")

    q_res, s_res = run(x, 64)  # 64 values a thread: every k here held in registers
    q_long, s_long = run(x, 0)  # none: every row through the long-row kernel
    assert torch.equal(s_res, s_long) and torch.equal(q_res, q_long)
    # the resident kernel with the norm's weight loaded ahead of the sum and behind it
    for ahead in (False, True):
        monkeypatch.setattr(kq, "NORM_WEIGHT_AHEAD", ahead)
        q_other, s_other = run(x, 64)
        assert torch.equal(s_res, s_other) and torch.equal(q_res, q_other), ahead
    assert s_res[1] == 0 and not q_res[1].any()
    if mode != "norm":  # and the torch reference's, which the plain quantization equals
        q_ref, s_ref = quantize_rows_reference(x, vec if mode == "divisor" else None)
        assert torch.equal(s_res, s_ref) and torch.equal(q_res, q_ref)
    # a row alone: the same bits as among the others, on either kernel
    for resident_values in (64, 0):
        q1, s1 = run(x[m - 1 :].clone(), resident_values)
        assert torch.equal(q1, q_res[m - 1 :]) and torch.equal(s1, s_res[m - 1 :])


def test_long_rows_take_the_long_row_kernel() -> None:
    """Where the line falls at the default RESIDENT_VALUES (the launches recorded, not run):
    rows up to 24,576 plain (the 27B MLP's 17,408 among them, at 16 warps) and 8,192 normed are
    held in registers, longer ones streamed."""
    from engine.kernels.aot import record

    def kernel_of(k: int, norm: bool) -> str:
        x, w = torch.zeros(2, k), torch.ones(k)
        with record() as launches:
            if norm:
                rms_norm_quantize(x, w, EPS, backend="triton")
            else:
                quantize_rows(x, w, backend="triton")
        (launch,) = launches
        return launch.name

    assert kernel_of(17408, False) == kernel_of(24576, False) == "_quant_resident_kernel"
    assert kernel_of(8192, True) == "_quant_resident_kernel"
    assert kernel_of(24577, False) == kernel_of(8193, True) == "_quant_long_row_kernel"


def test_resident_blocking_keeps_the_norms_block_and_fits_rows() -> None:
    from engine.kernels.quant import RESIDENT_VALUES, WIDE_RESIDENT_VALUES, pass_blocking, resident_blocking

    for k in (16, 40, 300, 2560, 4096, 5000, 5120, 6144, 8192, 10240, 12288, 17408, 40000):
        for norm in (False, True):
            got = resident_blocking(k, norm)
            if got is None:
                assert k > (8 * 32 * RESIDENT_VALUES if norm else 16 * 32 * WIDE_RESIDENT_VALUES), k
                continue
            block, warps = got
            if norm:  # the long-row kernel's block and warps: the sum's order depends on them
                assert (block, warps) == pass_blocking(k)
                whole = min(1 << (k - 1).bit_length(), 4096)  # the row's power of two, capped
                assert warps == (8 if whole >= 2048 else 4)
                assert block == min(whole, 4 * 32 * warps)  # 4 values a thread a block
            values = RESIDENT_VALUES if norm or warps < 16 else WIDE_RESIDENT_VALUES
            assert -(-k // block) * block <= values * 32 * warps
            if warps == 16:  # 16-byte loads: at least 4 values a thread in every block
                assert block >= 4 * 32 * 16 or block >= k, (k, block)
    assert resident_blocking(6144, False) == (2048, 8)  # 3 full blocks, not 2 x 4,096
    assert resident_blocking(5120, True) == (1024, 8)  # 5 blocks of 4 values a thread
    # 16 warps, blocks of 2,048 (4 values a thread): 9 blocks, 36 values a thread
    assert resident_blocking(17408, False) == (2048, 16)
    assert resident_blocking(10240, False) == (2048, 16)  # 5 full blocks: the rule's own block


_LAYOUTS = r"""
import sys
import torch
import engine.kernels.norm as kn
import engine.kernels.quant as kq
from engine.kernels.aot import compile_launch, record

kq.RESIDENT_VALUES = kn.RESIDENT_VALUES = int(sys.argv[1])  # 0: the long-row kernels
with record() as launches:
    for k in (1000, 2560, 5120):  # quant: blocks of 512 (4 warps), 1,024 (8); norm: 1,024, 4,096
        kq.rms_norm_quantize(torch.zeros(4, k), torch.zeros(k), 1e-6, backend="triton")
        kn.norm_rows(torch.zeros(4, k), torch.zeros(k), 1e-6, backend="triton")
        kn.norm_rows(torch.zeros(4, k), None, 1e-6, mean=False, backend="triton")
for launch in launches:
    compile_launch(launch)
"""


@pytest.mark.slow
def test_resident_norms_reduce_over_the_long_row_layouts(tmp_path) -> None:  # noqa: ANN001
    """Compiled for sm_90 (no GPU needed), the resident norm kernels' sums of squares reduce
    tensors of the same shapes in the same layouts as the long-row kernels': the lowering of
    `tl.sum` (per-thread order, shuffles, cross-warp step) follows from those alone, and the
    lanes hold the same values, so the sums are the same bits on the GPU too (the interpreter
    tests above cannot see the GPU's reduction order)."""
    pytest.importorskip("triton.backends.nvidia")
    from tests.engine.kernels.layouts import compile_script, sum_layouts

    got = {}
    for kernel, resident_values in (("long_row", "0"), ("resident", "32")):
        compile_script(_LAYOUTS, [resident_values], tmp_path / kernel)
        # keyed by family: _quant_resident / _quant_long_row -> quant, _norm_... -> norm
        sums = {
            f"{name.split('_')[1]} {shape} {layout}" for name, shape, layout in sum_layouts(tmp_path / kernel)
        }
        got[kernel] = sorted(sums)
    import engine.kernels.quant as kq

    quant_blocks = {kq.pass_blocking(k)[0] for k in (1000, 2560, 5120)}
    assert quant_blocks == {512, 1024}  # one block (1,000), several (2,560 and 5,120)
    assert all(any(f"quant {n}xf32" in g for g in got["long_row"]) for n in quant_blocks), got
    assert all(any(f"norm {n}xf32" in g for g in got["long_row"]) for n in (1024, 4096)), got
    assert got["resident"] == got["long_row"], got
