"""The gate+up GEMM with SwiGLU in its epilogue (`int8_gemm_swiglu`).

The weight is the MLP's stored layout, gate and up rows interleaved (`interleave_gate_up`). The
acceptance is the unfused path's bits: `quantize_rows(int8_gemm_swiglu(...), smooth)` equals
`swiglu_quantize(y, smooth)` of the stacked `int8_gemm`'s output y, q and scale, with and without a
SmoothQuant divisor. v itself is checked bit for bit against `_swiglu_value` applied by a small
Triton kernel to the separate gate and up linears' reference GEMMs (torch's exp is not Triton's,
so the torch reference agrees only to rounding). Interpreted on CPU, compiled on CUDA (conftest).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.kernels._triton import kernel
from engine.kernels.decode_quant import _swiglu_value, swiglu_quantize
from engine.kernels.gate_up import interleave_gate_up, split_gate_up
from engine.kernels.int8_gemm import (
    SWIGLU_CANDIDATES,
    SWIGLU_SMALL,
    SWIGLU_TABLE,
    GemmConfig,
    int8_gemm,
    int8_gemm_reference,
    int8_gemm_swiglu,
    int8_gemm_swiglu_quantize,
    int8_gemm_swiglu_reference,
    swiglu_config_for,
)
from engine.kernels.quant import quantize_rows

tl: Any = None  # bound at the test kernel's first launch (engine.kernels._triton)

ON_CUDA = torch.cuda.is_available()
# small tiles for the interpreter: many tiles, edge rows and columns in both halves
SMALL = [GemmConfig(16, 16, 32, 4, 2), GemmConfig(32, 32, 64, 4, 2, group_m=2)]
CONFIGS = SMALL + ([c for c in SWIGLU_CANDIDATES] if ON_CUDA else [])


def _operands(gen: torch.Generator, m: int, k: int, inter: int, dev: torch.device):
    """int8 rows, the interleaved gate+up weight [2I, K] and their scales; scales sized so that
    silu sees both signs and |g| up to ~10."""
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    gate, up = torch.randint(-127, 128, (2, inter, k), dtype=torch.int8, generator=gen)
    a_scale = torch.rand(m, generator=gen) * 0.02 + 1e-3
    gate_scale, up_scale = torch.rand(2, inter, generator=gen) * (1.0 / k) + 1e-4
    w, w_scale = interleave_gate_up(gate, up), interleave_gate_up(gate_scale, up_scale)
    return a.to(dev), w.to(dev), a_scale.to(dev), w_scale.to(dev)


def _gate_and_up(w: torch.Tensor, w_scale: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The separate gate and up linears (weight, scales) of the interleaved weight, as copies."""
    return (w[0::2].contiguous(), w_scale[0::2].contiguous()), (
        w[1::2].contiguous(),
        w_scale[1::2].contiguous(),
    )


def _swiglu_values_kernel(g_ptr, u_ptr, v_ptr, n, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    """v = `_swiglu_value`(g, u) elementwise: the expression both SwiGLU paths compute."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0)
    u = tl.load(u_ptr + offs, mask=m, other=0.0)
    tl.store(v_ptr + offs, _swiglu_value(g, u, g_ptr, 0, offs, m, False), mask=m)


_swiglu_values = kernel(_swiglu_values_kernel)


def _oracle(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with Triton's own exp and division, gate and up the separate linears'
    reference GEMMs (not read off the interleaved output: the layout is under test too)."""
    (gw, gs), (uw, us) = _gate_and_up(w, w_scale)
    gate, up = int8_gemm_reference(a, gw, a_scale, gs), int8_gemm_reference(a, uw, a_scale, us)
    v = torch.empty_like(gate)
    n = gate.numel()
    _swiglu_values[(-(-n // 1024),)](gate, up, v, n, BLOCK=1024, num_warps=4, enable_fp_fusion=False)
    return v


def test_interleave_gate_up_alternates_rows_and_scales() -> None:
    """Hand-checked: row 2j is gate j, row 2j + 1 up j; scales likewise; shapes must match."""
    gate = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int8)
    up = torch.tensor([[-1, -2], [-3, -4], [-5, -6]], dtype=torch.int8)
    assert interleave_gate_up(gate, up).tolist() == [[1, 2], [-1, -2], [3, 4], [-3, -4], [5, 6], [-5, -6]]
    assert interleave_gate_up(torch.tensor([0.5, 1.5]), torch.tensor([2.5, 3.5])).tolist() == [
        0.5,
        2.5,
        1.5,
        3.5,
    ]
    with pytest.raises(ValueError, match="one shape"):
        interleave_gate_up(gate, up[:2])


def test_split_gate_up_inverts_the_interleave_along_either_dim() -> None:
    """Rows (the stored weight) and columns (the stacked GEMM's output): even indices gate, odd up;
    an odd size is refused."""
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(2, 5, 7, generator=gen)
    for dim in (0, 1, -1):
        both = interleave_gate_up(gate, up, dim=dim)
        assert both.shape[dim % 2] == 2 * gate.shape[dim % 2]
        g, u = split_gate_up(both, dim)
        assert torch.equal(g, gate) and torch.equal(u, up)
    cols = interleave_gate_up(gate, up, dim=-1)
    assert torch.equal(cols[:, 0], gate[:, 0]) and torch.equal(cols[:, 1], up[:, 0])
    with pytest.raises(ValueError, match="even size"):
        split_gate_up(torch.zeros(3, 5))


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize(("m", "k", "inter"), [(1, 64, 40), (37, 200, 150), (50, 256, 64)])
def test_kernel_equals_the_swiglu_of_the_reference_gemm_bitwise(
    gen: torch.Generator, dev: torch.device, config: GemmConfig, m: int, k: int, inter: int
) -> None:
    """Ragged M, K (not a multiple of block_k) and I (past the last tile in both halves)."""
    a, w, a_scale, w_scale = _operands(gen, m, k, inter, dev)
    got = int8_gemm_swiglu(a, w, a_scale, w_scale, backend="triton", config=config)
    assert got.shape == (m, inter) and got.dtype == torch.float32
    assert torch.equal(got, _oracle(a, w, a_scale, w_scale))
    torch.testing.assert_close(got, int8_gemm_swiglu_reference(a, w, a_scale, w_scale), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("config", [*SMALL, None], ids=str)
@pytest.mark.parametrize("m", [1, 5, 37])
def test_fused_path_equals_unfused_path_bitwise(
    gen: torch.Generator, dev: torch.device, config: GemmConfig | None, m: int
) -> None:
    """The acceptance: quantize_rows(fused v, s) == swiglu_quantize(stacked GEMM's output, s),
    q and scale bit for bit, with and without a divisor; a zero row too (scale 0, q 0)."""
    k, inter = 200, 150
    a, w, a_scale, w_scale = _operands(gen, m, k, inter, dev)
    a[-1] = 0
    divisor = (torch.rand(inter, generator=gen) + 0.5).to(dev)
    y = int8_gemm(a, w, a_scale, w_scale, backend="triton")
    v = int8_gemm_swiglu(a, w, a_scale, w_scale, backend="triton", config=config)
    for d in (None, divisor):
        q_old, s_old = swiglu_quantize(y, d, backend="triton")
        q_new, s_new = quantize_rows(v, d, backend="triton")
        assert torch.equal(q_new, q_old) and torch.equal(s_new, s_old)
        assert s_new[-1] == 0 and not q_new[-1].any()


def test_configs_and_rows_alone_give_the_packed_bits(gen: torch.Generator, dev: torch.device) -> None:
    """Any tile config, the table's config at each M, and a row alone or in any slice of the
    batch: the same bits (exact sums, an elementwise epilogue)."""
    a, w, a_scale, w_scale = _operands(gen, 40, 128, 72, dev)
    full = int8_gemm_swiglu(a, w, a_scale, w_scale, backend="triton", config=SMALL[0])
    for cfg in CONFIGS[1:] + [SWIGLU_SMALL, None]:
        assert torch.equal(int8_gemm_swiglu(a, w, a_scale, w_scale, backend="triton", config=cfg), full)
    for lo, hi in [(0, 1), (7, 8), (3, 20), (17, 40)]:
        part = int8_gemm_swiglu(a[lo:hi], w, a_scale[lo:hi], w_scale, backend="triton")
        assert torch.equal(part, full[lo:hi])


def test_swiglu_table_is_fixed_by_m() -> None:
    """Sorted buckets; M = 1 (the GEMV's decode row) keeps the unfused path; only tile configs."""
    bounds = [max_m for max_m, _ in SWIGLU_TABLE]
    assert bounds == sorted(bounds)
    assert swiglu_config_for(1) is None
    assert swiglu_config_for(10**6) == SWIGLU_TABLE[-1][1]
    for cfg in [c for _, c in SWIGLU_TABLE if c is not None] + list(SWIGLU_CANDIDATES):
        assert not (cfg.gemv or cfg.split_k > 1 or cfg.stream_k or cfg.persistent)


def test_bad_inputs_are_named(dev: torch.device) -> None:
    a = torch.zeros(4, 32, dtype=torch.int8, device=dev)
    s4 = torch.ones(4, device=dev)
    odd = torch.zeros(7, 32, dtype=torch.int8, device=dev)
    with pytest.raises(ValueError, match="interleaved"):
        int8_gemm_swiglu(a, odd, s4, torch.ones(7, device=dev))
    # the quantizing entry too: the same error before any launch
    with pytest.raises(ValueError, match="interleaved"):
        int8_gemm_swiglu_quantize(a, odd, s4, torch.ones(7, device=dev), torch.ones(3, device=dev))
    w = torch.zeros(8, 32, dtype=torch.int8, device=dev)
    with pytest.raises(ValueError, match="tile configs"):
        int8_gemm_swiglu(
            a,
            w,
            s4,
            torch.ones(8, device=dev),
            backend="triton",
            config=GemmConfig(16, 32, 32, 4, 2, split_k=2),
        )
