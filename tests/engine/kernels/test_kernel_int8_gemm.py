"""int8 GEMM kernel: exact integer product, epilogue bit-equal to the torch reference, row invariance."""

from __future__ import annotations

import importlib

import pytest
import torch

from engine.kernels.int8_gemm import (
    CONFIG_TABLE,
    SHAPE_TABLE,
    STREAMK_MAX_PIECES,
    GemmConfig,
    config_for,
    int8_gemm,
    int8_gemm_reference,
    int8_matmul_exact,
    streamk_programs,
)

ON_CUDA = torch.cuda.is_available()
SMALL = GemmConfig(16, 32, 32, 4, 2)  # many tiles and edge masks on tiny CPU shapes


def _operands(gen: torch.Generator, m: int, k: int, n: int, dev: torch.device):
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    a_scale = torch.rand(m, generator=gen) * 0.05 + 1e-3
    w_scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    return a.to(dev), w.to(dev), a_scale.to(dev), w_scale.to(dev)


def test_exact_integer_product(gen: torch.Generator, dev: torch.device) -> None:
    a, w, _, _ = _operands(gen, 19, 72, 40, dev)
    oracle = a.cpu().long() @ w.cpu().long().T  # int64 product: exact by construction
    assert torch.equal(int8_matmul_exact(a, w).cpu().long(), oracle)
    a1 = a[:1]  # M = 1 goes through torch._int_mm's padding on CUDA
    assert torch.equal(int8_matmul_exact(a1, w).cpu().long(), oracle[:1])


@pytest.mark.parametrize(
    ("m", "k", "n", "config"),
    [
        (1, 128, 128, None),  # decode row, table config, M far below the tile
        (37, 200, 300, SMALL),  # K, N not multiples of the tile: masked edges
        (64, 256, 96, SMALL),
        # split K, the last program of a tile finishing it: ragged K, fewer splits than asked
        (5, 200, 70, GemmConfig(16, 32, 32, 4, 2, split_k=3)),
        (33, 96, 64, GemmConfig(16, 32, 32, 4, 2, split_k=4)),  # more splits than K blocks need
        (1, 256, 96, GemmConfig(16, 32, 64, 4, 2, split_k=4)),  # decode row, whole K blocks
        (5, 200, 70, GemmConfig(16, 32, 32, 4, 2, split_k=3, split_fused=False)),  # second launch
        (2, 64, 48, GemmConfig(16, 32, 64, 4, 2, split_k=2)),  # one K block: no split at all
        # persistent TMA: 30 tiles over the programs, edges in M, N and K read as zeros
        (37, 208, 300, GemmConfig(16, 32, 32, 4, 2, persistent=True)),
        (37, 200, 300, GemmConfig(16, 32, 32, 4, 2, persistent=True)),  # rows not 16-byte: fallback
        # the epilogue on two column halves: edge columns in either half, with and without TMA
        (37, 200, 300, GemmConfig(16, 64, 32, 4, 2, epilogue_split=2)),
        (37, 208, 300, GemmConfig(16, 64, 32, 4, 2, persistent=True, epilogue_split=2)),
        (37, 208, 300, GemmConfig(16, 32, 32, 4, 2, persistent=True, warp_specialize=True)),
    ],
)
@pytest.mark.parametrize("res", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_bitwise(
    gen: torch.Generator,
    dev: torch.device,
    m: int,
    k: int,
    n: int,
    config: GemmConfig | None,
    res: torch.dtype | None,
    out_dtype: torch.dtype,
) -> None:
    a, w, a_scale, w_scale = _operands(gen, m, k, n, dev)
    residual = None if res is None else (torch.randn(m, n, generator=gen) * 4).to(res).to(dev)
    got = int8_gemm(a, w, a_scale, w_scale, residual, out_dtype, backend="triton", config=config)
    want = int8_gemm_reference(a, w, a_scale, w_scale, residual, out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("m", "k", "n", "config"),
    [
        # 21 steps over 8 programs (interpreter; on CUDA 21 programs of one step): tiles cut
        # into several pieces, ragged K
        (5, 200, 70, GemmConfig(16, 32, 32, 4, 2, stream_k=2)),
        # whole tiles, edges in M and N
        (37, 200, 300, GemmConfig(16, 32, 32, 4, 2, stream_k=1)),
        # 32-step tiles: the grid is cut so that no tile has more than STREAMK_MAX_PIECES pieces
        (3, 1024, 40, GemmConfig(16, 32, 32, 4, 2, stream_k=3)),
    ],
)
@pytest.mark.parametrize("res", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_streamk_equals_reference_bitwise(
    gen: torch.Generator,
    dev: torch.device,
    m: int,
    k: int,
    n: int,
    config: GemmConfig,
    res: torch.dtype | None,
    out_dtype: torch.dtype,
) -> None:
    test_kernel_equals_reference_bitwise(gen, dev, m, k, n, config, res, out_dtype)


def test_reference_epilogue_order(gen: torch.Generator) -> None:
    """The reference rounds row scale first, then column scale, then the residual add, in fp32."""
    a, w, a_scale, w_scale = _operands(gen, 3, 64, 5, torch.device("cpu"))
    residual = torch.randn(3, 5, generator=gen)
    acc = (a.double() @ w.double().T).float()
    step = [[0.0] * 5 for _ in range(3)]
    for i in range(3):
        for j in range(5):
            x = torch.tensor(acc[i, j].item(), dtype=torch.float32) * a_scale[i]
            x = x * w_scale[j]
            step[i][j] = (x + residual[i, j]).item()
    assert torch.equal(int8_gemm_reference(a, w, a_scale, w_scale, residual), torch.tensor(step))


def test_configs_give_identical_bits(gen: torch.Generator, dev: torch.device) -> None:
    a, w, a_scale, w_scale = _operands(gen, 40, 256, 128, dev)
    configs = [SMALL, GemmConfig(32, 64, 64, 4, 2), *[c for _, c in CONFIG_TABLE]]
    configs += [GemmConfig(16, 32, 32, 4, 2, split_k=s) for s in (2, 5)]
    configs += [
        GemmConfig(16, 32, 32, 4, 2, split_k=3, split_fused=False),
        GemmConfig(32, 16, 64, 4, 2, split_k=2),
    ]
    configs += [c for table in SHAPE_TABLE.values() for _, c in table]
    configs += [GemmConfig(16, 32, 32, 4, 2, persistent=True), GemmConfig(32, 64, 64, 4, 2, persistent=True)]
    configs += [
        GemmConfig(16, 64, 32, 4, 2, epilogue_split=2),
        GemmConfig(32, 64, 64, 4, 2, persistent=True, epilogue_split=2),
        GemmConfig(32, 64, 64, 4, 2, persistent=True, warp_specialize=True),
    ]
    configs += [GemmConfig(16, 32, 32, 4, 2, stream_k=s) for s in (1, 2, 5)]
    configs += [GemmConfig(32, 64, 64, 4, 2, stream_k=1)]
    outs = [int8_gemm(a, w, a_scale, w_scale, backend="triton", config=c) for c in configs]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_rows_do_not_depend_on_batch(gen: torch.Generator, dev: torch.device) -> None:
    big_m = 700 if ON_CUDA else 70  # on CUDA this crosses the config table's M thresholds
    k, n = (512, 384) if ON_CUDA else (64, 48)
    a, w, a_scale, w_scale = _operands(gen, big_m, k, n, dev)
    full = int8_gemm(a, w, a_scale, w_scale, backend="triton")
    for lo, hi in [(0, 1), (5, 22), (big_m - 64, big_m)]:
        part = int8_gemm(a[lo:hi], w, a_scale[lo:hi], w_scale, backend="triton")
        assert torch.equal(part, full[lo:hi])


def test_config_table_is_fixed_by_m() -> None:
    assert all(config_for(m) == config_for(1) for m in range(1, CONFIG_TABLE[0][0] + 1))
    assert config_for(10**6) == CONFIG_TABLE[-1][1]
    bounds = [max_m for max_m, _ in CONFIG_TABLE]
    assert bounds == sorted(bounds)
    for (n, k), table in SHAPE_TABLE.items():
        assert [b for b, _ in table] == sorted(b for b, _ in table)
        assert config_for(10**6, n, k) == table[-1][1]


def test_decode_rows_alone_equal_packed(gen: torch.Generator, dev: torch.device) -> None:
    """A decode row's bits are the same whether 1 or up to 64 rows run (each M bucket's config)."""
    a, w, a_scale, w_scale = _operands(gen, 64, 512, 80, dev)
    residual = torch.randn(64, 80, generator=gen).to(dev)
    full = int8_gemm(a, w, a_scale, w_scale, residual, backend="triton")
    for m in (1, 3, 16, 17, 40):
        part = int8_gemm(a[:m], w, a_scale[:m], w_scale, residual[:m], backend="triton")
        assert torch.equal(part, full[:m])
    assert torch.equal(full, int8_gemm_reference(a, w, a_scale, w_scale, residual))


@pytest.mark.parametrize("stream_k", [1, 3])
def test_streamk_decode_rows_alone_equal_packed(
    gen: torch.Generator, dev: torch.device, stream_k: int
) -> None:
    """Stream K cuts each M's steps differently among the programs (the step count grows with
    M's row tiles): a row's bits are still the same alone, in any batch and as the reference."""
    cfg = GemmConfig(16, 32, 64, 4, 2, stream_k=stream_k)
    a, w, a_scale, w_scale = _operands(gen, 40, 512, 80, dev)
    residual = torch.randn(40, 80, generator=gen).to(dev)
    full = int8_gemm(a, w, a_scale, w_scale, residual, backend="triton", config=cfg)
    assert torch.equal(full, int8_gemm_reference(a, w, a_scale, w_scale, residual))
    for lo, hi in [(0, 1), (3, 20), (17, 40)]:
        part = int8_gemm(a[lo:hi], w, a_scale[lo:hi], w_scale, residual[lo:hi], backend="triton", config=cfg)
        assert torch.equal(part, full[lo:hi])


@pytest.mark.parametrize("slots", [1, 4, 132, 264, 528])
def test_streamk_programs_bound_the_pieces(slots: int) -> None:
    """The grid `streamk_programs` picks: no more programs than slots or steps, and no tile's
    steps spread over more than STREAMK_MAX_PIECES programs' ranges (counted one by one)."""
    for tiles, k_blocks in [(1, 1), (1, 40), (3, 7), (40, 48), (129, 40), (40, 136), (272, 40), (5, 200)]:
        total = tiles * k_blocks
        p = streamk_programs(tiles, k_blocks, slots)
        assert 1 <= p <= max(1, min(slots, total))
        owner = [max(q for q in range(p) if q * total // p <= i) for i in range(total)]
        for t in range(tiles):
            pieces = len(set(owner[t * k_blocks : (t + 1) * k_blocks]))
            assert pieces <= STREAMK_MAX_PIECES, (tiles, k_blocks, slots, t, pieces)


def test_bad_inputs_are_named(dev: torch.device) -> None:
    a = torch.zeros(4, 32, dtype=torch.int8, device=dev)
    w = torch.zeros(8, 32, dtype=torch.int8, device=dev)
    s4, s8 = torch.ones(4, device=dev), torch.ones(8, device=dev)
    with pytest.raises(ValueError, match="int8 operands"):
        int8_gemm(a.float(), w, s4, s8)
    with pytest.raises(ValueError, match=r"a \[M, K\] and w \[N, K\]"):
        int8_gemm(a, w[:, :16], s4, s8)
    with pytest.raises(ValueError, match="scales"):
        int8_gemm(a, w, s8, s8)
    with pytest.raises(ValueError, match="residual"):
        int8_gemm(a, w, s4, s8, torch.zeros(4, 7, device=dev))
    with pytest.raises(ValueError, match="backend"):
        int8_gemm(a, w, s4, s8, backend="cuda")  # type: ignore[arg-type]


def test_split_counters_are_left_at_zero(gen: torch.Generator, dev: torch.device) -> None:
    """A fused split or stream-K GEMM resets its tiles' counters, so the kept buffer serves the
    next GEMM: repeated and differently tiled split GEMMs all equal the reference."""
    module = importlib.import_module("engine.kernels.int8_gemm")  # the package re-exports the function

    a, w, a_scale, w_scale = _operands(gen, 5, 200, 70, dev)
    want = int8_gemm_reference(a, w, a_scale, w_scale)
    configs = [GemmConfig(16, 32, 32, 4, 2, split_k=3), GemmConfig(16, 16, 64, 4, 2, split_k=2)]
    configs += [GemmConfig(16, 32, 32, 4, 2, stream_k=2), GemmConfig(16, 16, 64, 4, 2, stream_k=1)]
    for cfg in configs * 2:
        assert torch.equal(int8_gemm(a, w, a_scale, w_scale, backend="triton", config=cfg), want)
        assert int(module._COUNTERS[a.device].abs().sum()) == 0


GEMV = [GemmConfig(1, 8, 64, 4, 1, gemv=True), GemmConfig(4, 16, 128, 4, 1, gemv=True)]


@pytest.mark.parametrize("config", GEMV, ids=str)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 256, 40), (3, 300, 17), (4, 64, 8), (2, 1000, 33)])
@pytest.mark.parametrize("res", [None, torch.float32])
def test_gemv_equals_reference_bitwise(
    gen: torch.Generator,
    dev: torch.device,
    config: GemmConfig,
    m: int,
    k: int,
    n: int,
    res: torch.dtype | None,
) -> None:
    """The dp4a kernel (signed bytes across every lane of a word, K not a multiple of its step,
    N past the last program's rows) gives the reference's bits; M above its rows falls back."""
    a, w, a_scale, w_scale = _operands(gen, m, k, n, dev)
    a[0, :4] = torch.tensor([-127, 127, -1, 0], dtype=torch.int8)  # every byte lane, both signs
    residual = None if res is None else (torch.randn(m, n, generator=gen) * 4).to(res).to(dev)
    got = int8_gemm(a, w, a_scale, w_scale, residual, backend="triton", config=config)
    assert torch.equal(got, int8_gemm_reference(a, w, a_scale, w_scale, residual))


def test_gemv_rows_alone_equal_packed_and_odd_k_falls_back(gen: torch.Generator, dev: torch.device) -> None:
    a, w, a_scale, w_scale = _operands(gen, 4, 128, 24, dev)
    cfg = GEMV[1]
    packed = int8_gemm(a, w, a_scale, w_scale, backend="triton", config=cfg)
    for r in range(4):
        alone = int8_gemm(a[r : r + 1], w, a_scale[r : r + 1], w_scale, backend="triton", config=cfg)
        assert torch.equal(alone, packed[r : r + 1])
    a2, w2, s2, t2 = _operands(gen, 2, 130, 24, dev)  # K % 4 != 0: no word view
    got = int8_gemm(a2, w2, s2, t2, backend="triton", config=cfg)
    assert torch.equal(got, int8_gemm_reference(a2, w2, s2, t2))
