"""int8 x int8 GEMM with exact int32 accumulation and a fused, fixed-order fp32 epilogue.

    y = (acc.float() * a_scale[m]) * w_scale[n]   (+ residual[m, n])   -> fp32 or bf16

`acc` is the exact integer product of a [M, K] and the weight w [N, K] (kept [out, in]; the
kernel reads its column-major view). Integer sums are exact (|acc| <= K * 127^2 < 2^31 for
K < 133,000), so the tile config cannot change a single bit: configs are picked from a fixed
table by M for speed only, never by timing. The epilogue is elementwise in one fixed order,
compiled without FMA contraction, so row m of y depends on row m of a alone - the int8
path's batch-invariance contract - and equals the torch reference below bit for bit.

`int8_gemm_swiglu` is the MLP's gate+up GEMM (over the interleaved weight, `gate_up.interleave_gate_up`)
with silu(gate) * up in the same tile kernel's epilogue (half the bytes out; the unfused path's
bits after quantization).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels import cutlass_gemm
from engine.kernels._triton import Backend, cdiv, helper, kernel, use_triton
from engine.kernels.decode_quant import _swiglu_value
from engine.kernels.gate_up import split_gate_up
from engine.kernels.quant import quantize_rows

tl: Any = None  # bound to triton.language at first launch (see engine.kernels._triton)

INT32_SAFE_K = (2**31 - 1) // (127 * 127)  # largest K whose int32 sum cannot overflow


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    # > 1: K split over that many programs per output tile. Each writes its exact int32 partial
    # to its own workspace slice; the sum (exact, so its order is moot) then gets the one
    # epilogue - decode's small M has too few output tiles to keep the HBM busy otherwise.
    split_k: int = 1
    # split_k > 1: the program that finishes a tile last (an int32 counter per tile) sums the
    # slices and writes y, all in one launch; False: a second launch does it.
    split_fused: bool = True
    persistent: bool = False  # one program per SM walking tiles, operands by TMA (sm_90+)
    # 2: the epilogue runs on the tile's two column halves in turn, so the fp32 result and the
    # residual of only half the tile are live next to the int32 accumulator (a 128x256 tile
    # with 8 warps spills otherwise). Elementwise, so the bits cannot change.
    epilogue_split: int = 1
    # persistent only: Triton's automatic warp specialization of the tile loop (a producer warp
    # issues the TMA loads, the other warps run the MMAs and the epilogue, which then overlaps
    # the next tile's loads)
    warp_specialize: bool = False
    # decode's M <= 4: `_int8_gemv_kernel` (block_m rows at once, block_n weight rows per
    # program, block_k bytes of K a step) instead of a tensor-core tile (see the kernel)
    gemv: bool = False
    # > 0: stream K (`_int8_streamk_kernel`): that many programs per SM share the GEMM's
    # (tile, K block) steps in equal contiguous ranges, so every SM streams the same bytes
    # whatever the tile count (40 tiles of 128 columns at N = 5,120 leave 92 SMs idle).
    stream_k: int = 0

    def __str__(self) -> str:
        """Short and stable: the benchmark's JSON keys and the notes use it."""
        s = f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/s{self.num_stages}"
        if self.group_m != 8:
            s += f"/g{self.group_m}"
        if self.split_k > 1:
            s += f"/split{self.split_k}" + ("" if self.split_fused else "+pass")
        if self.persistent:
            s += "/tma"
        if self.epilogue_split > 1:
            s += f"/e{self.epilogue_split}"
        if self.warp_specialize:
            s += "/ws"
        if self.gemv:
            s += "/gemv"
        if self.stream_k:
            s += f"/sk{self.stream_k}"
        return s


# Decode (M <= 64) streams the weight: at M = 1 a 64x128 tile gives N / 128 programs (40 for
# N = 5,120), far too few to keep 132 SMs' loads in flight; narrow N tiles, long K steps and
# split K give thousands. (largest M, config): fixed, so a given M always runs the same
# program; any entry gives identical bits (exact int32, one epilogue). Set from the H200 sweep
# of 2026-12-01 14:05 UTC at tree 549ffa9 (ops/bench/bench_kernels.py --gemm-only, then
# ops/bench/gemm_table.py --margin 0.05; RESULTS.md): per M the config with the least
# step-weighted time over the 27B and 4B linears; the split-epilogue 128x128 tile with 4 warps
# (two programs per SM) replaced the persistent TMA tile at large M. M = 1: the dp4a GEMV, from
# the sweep of 2026-12-01 ~18:25 UTC at tree 3d38e28 (--m 1,4 --models 27B): 7.01 ms a 27B step
# over the linears against 8.42 for the tiles (HBM floor 6.00); at M = 4 the tiles stayed ahead.
# M in (4, 16], (16, 64], (64, 256] and (256, 384]: the sweep of 2026-12-02 ~06:08 UTC at tree
# 9866e5c over the 27B linears as the engine launches them, stacked inputs included (--m
# 16,64,256,384 --models 27B, then gemm_table.py --merge --margin 0.05; RESULTS.md session 8):
# 27B step sums 7.77 -> 7.31 ms at M = 16, 9.46 -> 8.47 at 64, 15.57 -> 14.97 at 256, 19.81 ->
# 19.03 at 384; stream K won only the MLP gate+up and the LM head at M = 64.
CONFIG_TABLE: tuple[tuple[int, GemmConfig], ...] = (
    (1, GemmConfig(1, 8, 512, 2, 1, gemv=True)),
    (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
    (16, GemmConfig(16, 64, 256, 4, 4)),
    (64, GemmConfig(64, 64, 256, 4, 5)),
    (384, GemmConfig(64, 128, 128, 4, 4)),
    (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
)

# Per weight shape (N, K), a table like CONFIG_TABLE that overrides it where the sweep found a
# better fixed config for that shape (by more than 5% at a swept M). Keyed by the weight alone,
# so a row's program still depends on M's bucket and the layer, never on which other rows
# share the call. 27B: (10240, 5120) GDN qkv, (6144, 5120) GDN z, (5120, 6144) GDN/attention
# out, (12288, 5120) attention q+gate, (1024, 5120) k/v, (17408, 5120) MLP gate/up, (5120,
# 17408) MLP down; 4B: K = 2560 / 4096 / 9216 rows alike. M = 1 rows: the GEMV config the
# 27B sweep found best for the shape (4 weight rows a program up to N = 6,144, 8 above; the
# k/v and LM head rows their own); the 4B shapes take the 27B rule, not swept themselves.
SHAPE_TABLE: dict[tuple[int, int], tuple[tuple[int, GemmConfig], ...]] = {
    (10240, 5120): (
        (1, GemmConfig(1, 8, 512, 2, 1, gemv=True)),
        (4, GemmConfig(16, 128, 512, 4, 3)),
        (16, GemmConfig(16, 128, 256, 4, 4)),
        (64, GemmConfig(64, 128, 128, 4, 4)),
        (256, GemmConfig(128, 128, 128, 8, 3)),
        (384, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
        (512, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (6144, 5120): (
        (1, GemmConfig(1, 4, 1024, 2, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (16, GemmConfig(16, 32, 512, 4, 4)),
        (256, GemmConfig(64, 128, 128, 4, 4)),
        (384, GemmConfig(128, 128, 128, 8, 3)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (5120, 6144): (
        (1, GemmConfig(1, 4, 1024, 2, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (16, GemmConfig(16, 64, 256, 4, 4)),
        (64, GemmConfig(64, 64, 256, 4, 5)),
        (384, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (12288, 5120): (
        (1, GemmConfig(1, 8, 512, 2, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (16, GemmConfig(16, 32, 512, 4, 4)),
        (64, GemmConfig(64, 128, 128, 4, 4)),
        (256, GemmConfig(128, 128, 128, 8, 3)),
        (384, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (1024, 5120): (
        (1, GemmConfig(1, 8, 2048, 4, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=4)),
        (64, GemmConfig(16, 32, 512, 4, 4)),
        (512, GemmConfig(64, 128, 128, 4, 4, split_k=2)),
        (2048, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (17408, 5120): (
        (1, GemmConfig(1, 8, 512, 2, 1, gemv=True)),
        (16, GemmConfig(16, 256, 256, 8, 3)),
        (256, GemmConfig(64, 128, 128, 4, 4)),
        (384, GemmConfig(128, 128, 128, 8, 3)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (5120, 17408): (
        (1, GemmConfig(1, 4, 1024, 2, 1, gemv=True)),
        (16, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (64, GemmConfig(64, 64, 256, 4, 5)),
        (384, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (248320, 5120): (
        (1, GemmConfig(1, 8, 1024, 4, 1, gemv=True)),
        (4, GemmConfig(16, 128, 512, 4, 3)),
        (16, GemmConfig(16, 64, 256, 4, 4)),
        (64, GemmConfig(64, 128, 256, 4, 4, stream_k=1)),
        (384, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (8192, 2560): (
        (1, GemmConfig(1, 8, 512, 2, 1, gemv=True)),
        (4, GemmConfig(16, 128, 256, 4, 4)),
        (16, GemmConfig(16, 32, 512, 4, 4)),
        (256, GemmConfig(64, 128, 128, 4, 4)),
        (384, GemmConfig(128, 128, 128, 8, 3)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (4096, 2560): (
        (1, GemmConfig(1, 4, 1024, 2, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (16, GemmConfig(16, 32, 512, 4, 4)),
        (64, GemmConfig(16, 128, 256, 4, 4)),
        (512, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (2560, 4096): (
        (1, GemmConfig(1, 4, 1024, 2, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (16, GemmConfig(16, 32, 512, 4, 4)),
        (64, GemmConfig(64, 64, 256, 4, 4, split_k=2)),
        (512, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (1024, 2560): (
        (1, GemmConfig(1, 4, 1024, 2, 1, gemv=True)),
        (64, GemmConfig(16, 32, 512, 4, 4)),
        (2048, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (9216, 2560): (
        (1, GemmConfig(1, 8, 512, 2, 1, gemv=True)),
        (16, GemmConfig(16, 128, 256, 4, 4)),
        (64, GemmConfig(64, 128, 128, 4, 4)),
        (256, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
        (384, GemmConfig(128, 128, 128, 8, 3)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (2560, 9216): (
        (1, GemmConfig(1, 4, 1024, 2, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (16, GemmConfig(16, 64, 512, 4, 3, split_k=4)),
        (64, GemmConfig(64, 64, 256, 4, 4, split_k=2)),
        (512, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (248320, 2560): (
        (1, GemmConfig(1, 8, 1024, 4, 1, gemv=True)),
        (4, GemmConfig(16, 128, 256, 4, 4)),
        (16, GemmConfig(16, 32, 512, 4, 4)),
        (384, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (16480, 5120): (
        (1, GemmConfig(1, 8, 512, 2, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (16, GemmConfig(16, 64, 256, 4, 4)),
        (64, GemmConfig(64, 128, 128, 4, 6)),
        (256, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
        (384, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (14336, 5120): (
        (1, GemmConfig(1, 8, 512, 2, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (16, GemmConfig(16, 64, 256, 4, 4)),
        (64, GemmConfig(64, 128, 128, 4, 6)),
        (256, GemmConfig(128, 128, 128, 8, 3)),
        (384, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
    (34816, 5120): (
        (1, GemmConfig(1, 8, 512, 2, 1, gemv=True)),
        (4, GemmConfig(16, 64, 256, 4, 4, split_k=2)),
        (16, GemmConfig(16, 64, 256, 4, 4)),
        (64, GemmConfig(64, 128, 256, 4, 4, stream_k=1)),
        (256, GemmConfig(64, 128, 128, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 128, 4, 3, epilogue_split=2)),
    ),
}


# The MLP's gate+up GEMM with SwiGLU in its epilogue (`int8_gemm_swiglu`): (largest M, config or
# None), fixed per M bucket like CONFIG_TABLE. block_n is the output columns of a tile; the tile
# reads 2 * block_n weight rows (gate and up), so 64 here is the plain table's 128-wide tile. Tile
# configs only (the tile kernel: no split K, stream K, GEMV or TMA). None: that M keeps the
# unfused path (stacked GEMM, then `swiglu_quantize`): M = 1 runs the dp4a GEMV, and the 27B's
# stacked gate+up runs split K at M <= 4 and stream K in (16, 64], which the fused form lacks.
# Any entry gives the unfused path's bits, so a bucket's choice is for speed alone. Set from the
# H200 run of 2026-12-02 ~13:55 UTC (ops/bench/bench_swiglu.py at tree 618454b, RESULTS.md session
# 9), fused GEMM + quantize_rows against stacked GEMM + swiglu_quantize, 27B us per layer: M = 16
# 46.9 + 8.5 vs 62.5; M = 256 ~119 vs 131.9 and M = 384 ~155 vs 168.7 (128x64x128/w8/s3);
# M = 1,024 ~346 vs 368; M = 8,192 2,295 + 434 vs 2,842 (128x64x128/w4/s3). The quantizer's
# 17,408 row runs resident there (quant.RESIDENT_VALUES 48). At M = 1 and 64 the fused forms lost.
SWIGLU_SMALL = GemmConfig(16, 32, 256, 4, 4)  # a decode tile: where the table says None (calls at any M)
SWIGLU_TABLE: tuple[tuple[int, GemmConfig | None], ...] = (
    (4, None),
    (16, SWIGLU_SMALL),
    (64, None),
    (1024, GemmConfig(128, 64, 128, 8, 3)),
    (1 << 62, GemmConfig(128, 64, 128, 4, 3)),
)

# The fused form's configs the GPU sweep tries at each M (block_n: output columns of a tile).
SWIGLU_CANDIDATES: tuple[GemmConfig, ...] = (
    GemmConfig(16, 32, 256, 4, 4),
    GemmConfig(16, 64, 256, 4, 4),
    GemmConfig(64, 32, 256, 4, 4),
    GemmConfig(64, 64, 128, 4, 4),
    GemmConfig(64, 64, 256, 4, 3),
    GemmConfig(128, 64, 128, 4, 3),
    GemmConfig(128, 64, 128, 8, 3),
    GemmConfig(128, 128, 128, 8, 3),
    GemmConfig(128, 64, 64, 4, 4),
)


def swiglu_config_for(m: int) -> GemmConfig | None:
    """The fused gate+up+SwiGLU config for M rows, or None where M keeps the unfused path."""
    for max_m, cfg in SWIGLU_TABLE:
        if m <= max_m:
            return cfg
    return SWIGLU_TABLE[-1][1]


def swiglu_fused(m: int, w: torch.Tensor) -> bool:
    """Whether the MLP's gate+up over M rows and the stacked weight w [2I, K] runs fused
    (`int8_gemm_swiglu`, then `quantize_rows`) or as the stacked GEMM then `swiglu_quantize`: the
    same bits either way, so this is speed alone. Where the CUTLASS library serves the stacked
    GEMM, fused from `cutlass_gemm.SWIGLU_MIN_ROWS` rows on (its one-GEMM form) and unfused below
    (`cutlass_gemm`'s docstring has the measurements); elsewhere SWIGLU_TABLE (Triton's tiles,
    session 9)."""
    if swiglu_config_for(m) is None:
        return False
    return cutlass_gemm.serves_rows(m, w) is None or cutlass_gemm.swiglu_serves(m)


def config_for(m: int, n: int | None = None, k: int | None = None) -> GemmConfig:
    """The fixed config for M rows (of a weight [n, k] when given): a table lookup, never timed."""
    table = SHAPE_TABLE.get((n, k), CONFIG_TABLE) if n is not None and k is not None else CONFIG_TABLE
    for max_m, cfg in table:
        if m <= max_m:
            return cfg
    return table[-1][1]


def _int8_gemm_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EPI: tl.constexpr, SWIGLU: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """The tile kernel: a [BM, BN] output tile per program, in grouped order.

    SWIGLU: w is the MLP's interleaved gate+up weight [2N, K] (row 2j gate j, row 2j + 1 up j;
    w_scale likewise) and y [M, N] gets silu(gate) * up. The tile is then BN // 2 output columns
    j: its BN weight rows are the gate rows 2j (left half) and the up rows 2j + 1 (right half)
    side by side, so one dot (the same exact int32 sums as the plain GEMM's columns 2j and
    2j + 1) gives both accumulators, and `_swiglu_epilogue` combines them (see `int8_gemm_swiglu`).
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN // (1 + SWIGLU))  # output column tiles (half a tile's width with SWIGLU)
    # grouped tile order: GROUP_M row-tiles share each weight column-tile while it is in L2
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    # rows/cols past the edge re-read row/col 0 instead of masking; they are never stored
    rows = tl.where(offs_m < M, offs_m, 0)
    if SWIGLU:
        lane = tl.arange(0, BN)
        offs_n = pid_n * (BN // 2) + lane % (BN // 2)  # output column j of each weight row
        cols = tl.where(offs_n < N, 2 * offs_n + (lane >= BN // 2), 0)  # gate 2j, then up 2j + 1
    else:
        offs_n = pid_n * BN + tl.arange(0, BN)
        cols = tl.where(offs_n < N, offs_n, 0)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for kb in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            rem = K - kb * BK
            a = tl.load(a_ptrs, mask=offs_k[None, :] < rem, other=0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < rem, other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BK * stride_ak
        w_ptrs += BK * stride_wk

    if SWIGLU:
        _swiglu_epilogue(
            acc, offs_m, pid_n * (BN // 2), M, N, a_scale_ptr, w_scale_ptr, y_ptr, stride_ym, stride_yn,
            BM, BN // 2,
        )  # fmt: skip
    else:
        _epilogue_tile(
            acc, offs_m, pid_n * BN, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
            stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, BM, BN, EPI, ON_GPU,
        )  # fmt: skip


def _int8_gemm_tma_kernel(
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
    M, N, K, num_programs, stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EPI: tl.constexpr, WS: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Persistent: program p computes tiles p, p + num_programs, ... in the grouped order of
    `_int8_gemm_kernel`; operand tiles come by TMA (tensor descriptors), whose reads past an
    edge are zeros, so no masks. Each tile's int32 sum and epilogue are the other kernel's."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, num_programs, warp_specialize=WS):
        first_m = (tile // width) * GROUP_M
        group_size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % width) % group_size
        pid_n = (tile % width) // group_size
        acc = tl.zeros((BM, BN), dtype=tl.int32)
        for kb in range(0, tl.cdiv(K, BK)):
            a = a_desc.load([pid_m * BM, kb * BK])
            w = w_desc.load([pid_n * BN, kb * BK])
            acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
        offs_m = pid_m * BM + tl.arange(0, BM)
        _epilogue_tile(
            acc, offs_m, pid_n * BN, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
            stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, BM, BN, EPI, ON_GPU,
        )  # fmt: skip


def _epilogue_tile(
    acc, offs_m, n0, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
    stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    EPI: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """The epilogue of a [BM, BN] tile whose columns start at n0: whole (EPI 1) or as two
    [BM, BN / 2] halves in turn (EPI 2; `GemmConfig.epilogue_split`)."""
    if EPI == 2:
        left, right = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        _epilogue(
            left, offs_m, n0 + tl.arange(0, BN // 2), M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
            stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
        )  # fmt: skip
        _epilogue(
            right, offs_m, n0 + BN // 2 + tl.arange(0, BN // 2), M, N, a_scale_ptr, w_scale_ptr, res_ptr,
            y_ptr, stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
        )  # fmt: skip
    else:
        _epilogue(
            acc, offs_m, n0 + tl.arange(0, BN), M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
            stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
        )  # fmt: skip


def _epilogue(
    acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
    stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """y[m, n] = (acc * a_scale[m]) * w_scale[n] (+ residual), stored as fp32 or bf16."""
    a_s = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    w_s = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    y = (acc.to(tl.float32) * a_s[:, None]) * w_s[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_RES:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn, mask=mask, other=0.0)
        y = y + r.to(tl.float32)
    if OUT_BF16:
        if ON_GPU:
            y = y.to(tl.bfloat16)  # cvt.rn: round to nearest even, as torch
        else:
            # the interpreter truncates fp32 -> bf16; round to nearest even by hand (finite y)
            bits = y.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, y, mask=mask)


def _swiglu_epilogue(
    acc, offs_m, n0, M, N, a_scale_ptr, w_scale_ptr, y_ptr, stride_ym, stride_yn,
    BM: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """y[m, j] = silu(g) * u for the HALF output columns j from n0, acc [BM, 2 * HALF] holding
    the gate sums (left half) and the up sums (right half): g and u are the plain epilogue's
    values of interleaved columns 2j and 2j + 1, and v is `decode_quant._swiglu_value`'s
    expression (the same helper, divisor-free), so v is bit for bit what `swiglu_quantize`
    computes from the unfused GEMM's fp32 output - and its quantization `quantize_rows(v, smooth)`
    gives `swiglu_quantize(y, smooth)`'s bits."""
    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, HALF)), (0, 2, 1)))
    offs_n = n0 + tl.arange(0, HALF)
    mask_n = offs_n < N
    a_s = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    g = (acc_g.to(tl.float32) * a_s) * tl.load(w_scale_ptr + 2 * offs_n, mask=mask_n, other=0.0)[None, :]
    u = (acc_u.to(tl.float32) * a_s) * tl.load(w_scale_ptr + 2 * offs_n + 1, mask=mask_n, other=0.0)[None, :]
    mask = (offs_m[:, None] < M) & mask_n[None, :]
    v = _swiglu_value(g, u, w_scale_ptr, 0, offs_n, mask_n, False)  # no divisor: pointer unread
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, v, mask=mask)


def _int8_split_kernel(
    a_ptr, w_ptr, ws_ptr, count_ptr, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
    M, N, K, k_per_split, splits,
    stride_am, stride_ak, stride_wn, stride_wk, stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr, EVEN_K: tl.constexpr, FUSED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Split K: program (tile, split) computes the exact int32 product over its K slice and
    stores it in its own slice ws[split] (plain stores: no zeroing, no atomics on data).

    FUSED: then it counts itself done on the tile's counter; the one that arrives last adds the
    other slices to its own (integers: the sum is the same in any order) and runs the shared
    epilogue. The release/acquire pair on the counter orders the slices' stores before their
    loads; the loads bypass L1 (`.cg`), which is not coherent across SMs. That program then
    puts the counter back to 0, so the counters (`_tile_counters`) are zeroed once per device,
    not by a memset launch before every GEMM (~2-3 us of a 10-30 us decode GEMM in a graph).
    """
    num_n = tl.cdiv(N, BN)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tile // num_n
    pid_n = tile % num_n
    k0 = split * k_per_split
    k_len = tl.minimum(K - k0, k_per_split)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    rows = tl.where(offs_m < M, offs_m, 0)
    cols = tl.where(offs_n < N, offs_n, 0)
    a_ptrs = a_ptr + rows[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for kb in range(0, tl.cdiv(k_len, BK)):
        if EVEN_K:  # K % BK == 0 and k_per_split % BK == 0: every block is whole
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            rem = k_len - kb * BK
            a = tl.load(a_ptrs, mask=offs_k[None, :] < rem, other=0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < rem, other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BK * stride_ak
        w_ptrs += BK * stride_wk
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    slice_mn = offs_m[:, None] * N + offs_n[None, :]
    if FUSED:
        tl.store(ws_ptr + split * M * N + slice_mn, acc, mask=mask)
        tl.debug_barrier()  # every thread's slice stores precede the release below
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == splits - 1:
            for s in range(0, splits):
                if s != split:
                    acc += tl.load(ws_ptr + s * M * N + slice_mn, mask=mask, other=0, cache_modifier=".cg")
            _epilogue(
                acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
                stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
            )  # fmt: skip
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next GEMM
    else:
        tl.store(ws_ptr + split * M * N + slice_mn, acc, mask=mask)


def _int32_epilogue_kernel(
    ws_ptr, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr, M, N, splits,
    stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """The unfused split's second launch: the slices summed in split order, then the epilogue."""
    num_n = tl.cdiv(N, BN)
    offs_m = (tl.program_id(0) // num_n) * BM + tl.arange(0, BM)
    offs_n = (tl.program_id(0) % num_n) * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for s in range(0, splits):
        acc += tl.load(ws_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0)
    _epilogue(
        acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
        stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
    )  # fmt: skip


def _cta_barrier(ON_GPU: tl.constexpr):
    """All threads of the program meet here (`bar.sync`: also orders their memory accesses).

    Not `tl.debug_barrier()`: inside a loop, that op stops Triton from pipelining the loop's
    loads (sm_90, Triton 3.6); this inline form is emitted after the pipeliner has run. The
    interpreter runs a program's threads as one, so it needs nothing."""
    if ON_GPU:
        tl.inline_asm_elementwise(
            "bar.sync 0;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


def _int8_streamk_kernel(
    a_ptr, w_ptr, ws_ptr, count_ptr, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
    M, N, K, num_programs,
    stride_am, stride_ak, stride_wn, stride_wk, stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MAX_PIECES: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """Stream K: the GEMM's steps (tile, K block), tile-major, cut into `num_programs` equal
    contiguous ranges; program p walks steps [p * T // P, (p + 1) * T // P).

    Why: a decode GEMM only streams its weight, so it is as fast as its slowest SM. Tiles per
    program (the tile and split kernels) leave SMs idle or a last partial wave (40 tiles at
    N = 5,120, 272 at N = 34,816 on 264 program slots, 160 split programs on 132); here every
    program streams the same bytes (+-1 step), all in one wave.

    One flat loop over the range (so Triton pipelines the loads across tile boundaries too):
    where a tile's steps end, or the range does, the piece is flushed. A whole tile runs the
    shared epilogue at once; a piece stores its exact int32 partial in the program's own slot
    (first piece of the range: slot 0, last: slot 1), then adds its step count to the tile's
    counter; the program that completes the count sums the pieces' slots (integers: any order,
    the same value) and runs the epilogue, then resets the counter (as the split kernel). A
    tile's pieces come from at most MAX_PIECES consecutive programs (the host sizes the grid
    so), read in a static loop: Triton pipelines only innermost loops.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    kpt = tl.cdiv(K, BK)  # K blocks (steps) per tile
    total = tl.cdiv(M, BM) * num_n * kpt
    start = pid * total // num_programs
    end = (pid + 1) * total // num_programs
    offs_k = tl.arange(0, BK)
    ar = tl.arange(0, BM)
    an = tl.arange(0, BN)
    slot_mn = ar[:, None] * BN + an[None, :]  # a [BM, BN] slot, unmasked (rows/cols past the edge unused)
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    piece = start  # first step of the piece being accumulated
    # the step's K block and tile, carried from step to step (no divisions in the loop)
    kb = start % kpt
    pid_m = start // kpt // num_n
    pid_n = start // kpt % num_n
    for it in range(start, end):
        tile = pid_m * num_n + pid_n
        offs_m = pid_m * BM + ar
        offs_n = pid_n * BN + an
        # rows/cols past the edge re-read row/col 0 instead of masking; they are never stored
        rows = tl.where(offs_m < M, offs_m, 0)
        cols = tl.where(offs_n < N, offs_n, 0)
        ks = kb * BK + offs_k
        a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
        w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=ks[None, :] < K, other=0)
            w = tl.load(w_ptrs, mask=ks[:, None] < K, other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        if (kb == kpt - 1) | (it == end - 1):
            first = tile * kpt  # the tile's first step
            if (piece == first) & (kb == kpt - 1):  # the whole tile in this program
                _epilogue(
                    acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
                    stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
                )  # fmt: skip
            else:
                slot = (pid * 2 + (piece != start).to(tl.int32)) * (BM * BN)
                tl.store(ws_ptr + slot + slot_mn, acc)
                _cta_barrier(ON_GPU)  # every thread's slot stores precede the release below
                done = tl.atomic_add(count_ptr + tile, it + 1 - piece, sem="acq_rel", scope="gpu")
                if done + (it + 1 - piece) == kpt:  # the tile's last piece: finish it
                    # every piece's slot, this program's own too (read back: the MMA-layout
                    # accumulator plus loaded tiles would spill), in the loads' own layout
                    p_lo = ((first + 1) * num_programs + total - 1) // total - 1  # owner of `first`
                    tile_acc = tl.zeros((BM, BN), dtype=tl.int32)
                    for j in tl.static_range(MAX_PIECES):
                        p = p_lo + j
                        p_start = p * total // num_programs
                        lo = tl.maximum(p_start, first)
                        if lo < tl.minimum((p + 1) * total // num_programs, first + kpt):
                            other = (p * 2 + (lo != p_start).to(tl.int32)) * (BM * BN)
                            tile_acc += tl.load(ws_ptr + other + slot_mn, cache_modifier=".cg")
                    _epilogue(
                        tile_acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
                        stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
                    )  # fmt: skip
                    tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # ready for the next GEMM
            acc = tl.zeros((BM, BN), dtype=tl.int32)
            piece = it + 1
        last_kb = kb == kpt - 1
        kb = tl.where(last_kb, 0, kb + 1)
        pid_n = tl.where(last_kb, pid_n + 1, pid_n)
        pid_m = tl.where(pid_n == num_n, pid_m + 1, pid_m)
        pid_n = tl.where(pid_n == num_n, 0, pid_n)


def _dp4a(w, a, acc, ON_GPU: tl.constexpr):
    """acc + the dot of the four signed bytes packed in each int32 of w and a (elementwise).

    On the GPU one `dp4a.s32.s32` per word; the interpreter sign-extends each byte by shifts
    (int32 `<<` wraps, `>>` is arithmetic) and sums the four products. Integer arithmetic:
    the same value either way, and the same as the tensor-core product."""
    if ON_GPU:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, a, acc], dtype=tl.int32, is_pure=True, pack=1
        )
    out = acc
    for shift in tl.static_range(0, 32, 8):
        out += ((w << (24 - shift)) >> 24) * ((a << (24 - shift)) >> 24)
    return out


def _int8_gemv_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
    M, N, KW, stride_am, stride_wn, stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr, EVEN_K: tl.constexpr,
    MR: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Decode's M <= MR rows against BN weight rows per program, on the CUDA cores.

    Why: at M = 1 a tensor-core tile pads the row to 16 and stages the weight through shared
    memory; a decode GEMM only has to stream the weight once, so here each program reads its BN
    rows of w ([N, K] int8, viewed as int32 words of 4 bytes: KW = K / 4) straight into
    registers, BKW words a step, and multiplies them with the activations' words by dp4a. The
    products accumulate per (row, column, word lane) and are summed over the lanes at the end:
    exact int32 arithmetic, so the result - and after the shared `_epilogue`, every bit of y -
    is the tensor-core kernels'. One launch, no split K: N / BN programs (640 at N = 5,120 with
    BN = 8) are already several per SM.
    """
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, MR)
    offs_k = tl.arange(0, BKW)
    rows_w = tl.where(offs_n < N, offs_n, 0)  # past the edge: row 0 re-read, never stored
    rows_a = tl.where(offs_m < M, offs_m, 0)
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    acc = tl.zeros((MR, BN, BKW), dtype=tl.int32)
    for kb in range(0, tl.cdiv(KW, BKW)):
        if EVEN_K:
            w = tl.load(w_ptrs)
            a = tl.load(a_ptrs)
        else:
            rem = KW - kb * BKW
            w = tl.load(w_ptrs, mask=offs_k[None, :] < rem, other=0)
            a = tl.load(a_ptrs, mask=offs_k[None, :] < rem, other=0)
        acc = _dp4a(
            tl.broadcast_to(w[None, :, :], (MR, BN, BKW)),
            tl.broadcast_to(a[:, None, :], (MR, BN, BKW)),
            acc,
            ON_GPU,
        )
        w_ptrs += BKW
        a_ptrs += BKW
    _epilogue(
        tl.sum(acc, axis=2), offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
        stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
    )  # fmt: skip


_dp4a = helper(_dp4a)  # type: ignore[assignment]
_epilogue = helper(_epilogue)  # type: ignore[assignment]
_epilogue_tile = helper(_epilogue_tile)  # type: ignore[assignment]
_swiglu_epilogue = helper(_swiglu_epilogue)  # type: ignore[assignment]
_cta_barrier = helper(_cta_barrier)  # type: ignore[assignment]
_kernel = kernel(_int8_gemm_kernel)
_tma_kernel = kernel(_int8_gemm_tma_kernel)
_split = kernel(_int8_split_kernel)
_finish = kernel(_int32_epilogue_kernel)
_gemv = kernel(_int8_gemv_kernel)
_streamk = kernel(_int8_streamk_kernel)


STREAMK_MAX_PIECES = 8  # a stream-K tile's pieces (programs) at most: the finisher's static loop


def streamk_programs(tiles: int, k_blocks: int, slots: int) -> int:
    """Programs of a stream-K launch: one per slot (SMs x programs per SM), but few enough that
    each range holds >= ceil((k_blocks - 1) / (MAX_PIECES - 1)) steps, so that no tile is cut
    into more than STREAMK_MAX_PIECES pieces; never more programs than steps."""
    total = tiles * k_blocks
    min_steps = max(1, cdiv(k_blocks - 1, STREAMK_MAX_PIECES - 1))
    return max(1, min(slots, total // min_steps))


def _tma_ready(a: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs unit inner strides, 16-byte aligned rows and bases, and on CUDA sm_90+;
    otherwise the persistent config falls back to the pointer kernel (the same bits)."""
    for x in (a, w):
        if x.stride(1) != 1 or x.stride(0) % 16 or x.data_ptr() % 16:
            return False
    return not a.is_cuda or torch.cuda.get_device_capability(a.device)[0] >= 9


def _gemv_ready(a: torch.Tensor, w: torch.Tensor, cfg: GemmConfig) -> bool:
    """The word view needs M <= the config's rows, K a multiple of 4, unit inner strides, and
    rows and bases on 4-byte boundaries."""
    if a.shape[0] > cfg.block_m or a.shape[1] % 4:
        return False
    return all(x.stride(1) == 1 and x.stride(0) % 4 == 0 and x.data_ptr() % 4 == 0 for x in (a, w))


_COUNTERS: dict[torch.device, torch.Tensor] = {}
COUNTER_SLOTS = 1 << 16  # tiles of one split GEMM that the kept counters cover (256 KB)


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-tile arrival counters for a fused split GEMM, all 0: one buffer per device, zeroed
    once; every GEMM leaves it at 0 again (its last program per tile resets the counter).

    GEMMs on one device run one after another on its stream (the engine's and the decoder's
    graphs do), so they never share the buffer at the same time. Larger grids, or a first use
    during CUDA graph capture (no allocation may be kept from there), get fresh zeros.
    """
    buf = _COUNTERS.get(device)
    if buf is None and tiles <= COUNTER_SLOTS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(tiles, dtype=torch.int32, device=device)
        buf = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    if buf is None or tiles > buf.numel():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    return buf


def _processors(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (4 under the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def int8_matmul_exact(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 a @ w.T for int8 a [M, K], w [N, K] through torch (any M, K, N, any device)."""
    m, k = a.shape
    n = w.shape[0]
    if a.is_cuda:
        # torch._int_mm's CUDA rules: M > 16, K and N multiples of 8; zero padding adds nothing
        mp, kp, np_ = max(m, 17), -(-k // 8) * 8, -(-n // 8) * 8
        a_p = torch.nn.functional.pad(a, (0, kp - k, 0, mp - m))
        w_p = torch.nn.functional.pad(w, (0, kp - k, 0, np_ - n))
        return torch._int_mm(a_p, w_p.t())[:m, :n]
    # every product and partial sum is an integer far below 2^53: exact in float64
    return (a.double() @ w.double().t()).to(torch.int32)


def scale_int32(
    acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The one fixed fp32 epilogue in torch ops: (acc * row scale) * column scale (+ residual, last).

    Each step is one correctly rounded elementwise op, so a row's output depends on that row alone.
    """
    y = (acc.float() * a_scale.float()[:, None]) * w_scale.float()[None, :]
    return y if residual is None else y + residual.float()


def int8_gemm_reference(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The epilogue spelled out in torch ops: the oracle the kernel must equal bit for bit."""
    return scale_int32(int8_matmul_exact(a, w), a_scale, w_scale, residual).to(out_dtype)


def int8_gemm_swiglu_quantize(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    divisor: torch.Tensor | None,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's gate+up, SwiGLU and the quantization of v for ffn_down: (q int8 [M, I], scale fp32
    [M]) = `quantize_rows(int8_gemm_swiglu(a, w, a_scale, w_scale), divisor)`, w the interleaved
    gate+up weight. Dividing and folding the row absmax in the GEMM's epilogue instead (session 21's
    two-GEMM form did) costs the one-GEMM form more than the quantizer's own pass (`cutlass_gemm`'s
    docstring), so v is quantized after it."""
    _check_pairs(w)
    n = w.shape[0] // 2
    if divisor is not None and (divisor.shape != (n,) or divisor.device != a.device):
        raise ValueError(
            f"int8_gemm_swiglu_quantize: the divisor must be [{n}] on {a.device}, "
            f"got {tuple(divisor.shape)} on {divisor.device}"
        )
    v = int8_gemm_swiglu(a, w, a_scale, w_scale, backend=backend)
    return quantize_rows(v, divisor, backend="triton" if v.is_cuda else backend)


def _check_pairs(w: torch.Tensor) -> None:
    """w must be the MLP's interleaved gate+up weight: an even number of rows [2I, K]."""
    if w.dim() != 2 or w.shape[0] % 2:
        raise ValueError(f"int8_gemm_swiglu needs the interleaved gate+up weight [2I, K]: {tuple(w.shape)}")


def _pairs_form(a: torch.Tensor, w: torch.Tensor) -> tuple[cutlass_gemm.Library, str] | None:
    """(library, config) where Hopper's one-GEMM SwiGLU takes a's M rows times the interleaved w
    (from `cutlass_gemm.SWIGLU_MIN_ROWS` rows, where the table serves the stacked GEMM), else None."""
    if not cutlass_gemm.swiglu_serves(a.shape[0]):
        return None
    name = cutlass_gemm.serves(a, w, None, torch.float32)
    library = cutlass_gemm.library() if name else None
    if name is None or library is None:
        return None
    return library, cutlass_gemm.swiglu_config(name)


def int8_gemm_swiglu_reference(
    a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """v = silu(gate) * up in torch ops, gate and up the even and odd columns of the interleaved
    GEMM's output (`scale_int32`, bit for bit the kernel's). silu is g / (1 + exp(-g)), the kernel's
    expression, but torch's exp is not Triton's (the interpreter's numpy exp, or the GPU's
    ex2.approx), so v agrees with the kernel to rounding: the bit oracle is the unfused path (see the
    tests)."""
    gate, up = split_gate_up(scale_int32(int8_matmul_exact(a, w), a_scale, w_scale))
    return (gate / (1.0 + torch.exp(-gate))) * up


def _check(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    residual: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> None:
    if a.dtype != torch.int8 or w.dtype != torch.int8:
        raise ValueError(f"int8_gemm takes int8 operands, got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"int8_gemm needs a [M, K] and w [N, K], got {tuple(a.shape)} and {tuple(w.shape)}")
    m, k = a.shape
    n = w.shape[0]
    if k > INT32_SAFE_K:
        raise ValueError(f"K={k} could overflow the int32 accumulator (max {INT32_SAFE_K})")
    if a_scale.shape != (m,) or w_scale.shape != (n,):
        raise ValueError(
            f"scales must be a_scale [{m}] and w_scale [{n}], "
            f"got {tuple(a_scale.shape)} and {tuple(w_scale.shape)}"
        )
    if a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError(f"scales must be float32, got {a_scale.dtype} and {w_scale.dtype}")
    if residual is not None:
        if residual.shape != (m, n):
            raise ValueError(f"residual must be [{m}, {n}], got {tuple(residual.shape)}")
        if residual.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"residual must be float32 or bfloat16, got {residual.dtype}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    devices = {t.device for t in (a, w, a_scale, w_scale) + ((residual,) if residual is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"int8_gemm operands are on different devices: {sorted(map(str, devices))}")


def int8_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    *,
    backend: Backend = "auto",
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = (int32(a @ w.T) * a_scale[:, None]) * w_scale[None, :] (+ residual), fp32 or bf16.

    a int8 [M, K] (per-row quantized activations), w int8 [N, K] (per-output-channel weight),
    a_scale fp32 [M], w_scale fp32 [N], residual fp32/bf16 [M, N] or None. Any M >= 0.
    `config` overrides the fixed table (benchmarks only; the bits are the same). On an sm_90 GPU
    with the CUTLASS library built, "auto" hands the M buckets `cutlass_gemm.TABLE` names to it.
    """
    _check(a, w, a_scale, w_scale, residual, out_dtype)
    m, k = a.shape
    n = w.shape[0]
    if not use_triton(backend, a) or m == 0 or n == 0 or k == 0:
        return int8_gemm_reference(a, w, a_scale, w_scale, residual, out_dtype)
    if m * k >= 2**31 or n * max(k, w.stride(0)) >= 2**31 or m * n >= 2**31:  # w's rows may be strided
        raise ValueError(f"int8_gemm shape {m}x{k}x{n} exceeds 32-bit indexing")
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if config is None and backend == "auto" and (cutlass := cutlass_gemm.serves(a, w, residual, out_dtype)):
        cutlass_gemm.library().gemm(cutlass, a, w, a_scale, w_scale, residual, y)  # same bits: see it
        return y
    cfg = config or config_for(m, n, k)
    res = residual if residual is not None else y
    if cfg.gemv and _gemv_ready(a, w, cfg):
        _gemv[(cdiv(n, cfg.block_n),)](
            a.view(torch.int32), w.view(torch.int32), a_scale, w_scale, res, y, m, n, k // 4,
            a.stride(0) // 4, w.stride(0) // 4, res.stride(0), res.stride(1), y.stride(0), y.stride(1),
            HAS_RES=residual is not None, OUT_BF16=out_dtype == torch.bfloat16,
            EVEN_K=(k // 4) % (cfg.block_k // 4) == 0, MR=cfg.block_m, BN=cfg.block_n, BKW=cfg.block_k // 4,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        )  # fmt: skip
        return y
    if cfg.gemv:  # a shape the word view cannot take: the tensor-core decode tile (same bits)
        cfg = GemmConfig(16, 64, 256, 4, 4)
    if cfg.stream_k > 0:
        k_blocks = cdiv(k, cfg.block_k)
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
        programs = streamk_programs(tiles, k_blocks, _processors(a.device) * cfg.stream_k)
        if (programs + 1) * tiles * k_blocks < 2**31:  # the step arithmetic is int32
            ws = torch.empty(programs, 2, cfg.block_m, cfg.block_n, dtype=torch.int32, device=a.device)
            _streamk[(programs,)](
                a, w, ws, _tile_counters(a.device, tiles), a_scale, w_scale, res, y, m, n, k, programs,
                a.stride(0), a.stride(1), w.stride(0), w.stride(1),
                res.stride(0), res.stride(1), y.stride(0), y.stride(1),
                HAS_RES=residual is not None, OUT_BF16=out_dtype == torch.bfloat16,
                EVEN_K=k % cfg.block_k == 0, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                MAX_PIECES=STREAMK_MAX_PIECES,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
            )  # fmt: skip
            return y
        cfg = GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)  # same bits
    k_blocks = cdiv(k, cfg.block_k)
    if cfg.split_k > 1 and k_blocks > 1:
        k_per = cdiv(k_blocks, cfg.split_k) * cfg.block_k
        splits = cdiv(k, k_per)  # <= split_k: no split is empty
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
        ws = torch.empty(splits, m, n, dtype=torch.int32, device=a.device)
        counts = _tile_counters(a.device, tiles if cfg.split_fused else 1)
        _split[(tiles, splits)](
            a, w, ws, counts, a_scale, w_scale, res, y, m, n, k, k_per, splits,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1),
            res.stride(0), res.stride(1), y.stride(0), y.stride(1),
            HAS_RES=residual is not None, OUT_BF16=out_dtype == torch.bfloat16,
            EVEN_K=k % cfg.block_k == 0, FUSED=cfg.split_fused,
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        )  # fmt: skip
        if not cfg.split_fused:
            _finish[(tiles,)](
                ws, a_scale, w_scale, res, y, m, n, splits,
                res.stride(0), res.stride(1), y.stride(0), y.stride(1),
                HAS_RES=residual is not None, OUT_BF16=out_dtype == torch.bfloat16,
                BM=cfg.block_m, BN=cfg.block_n, num_warps=4, enable_fp_fusion=False,
            )  # fmt: skip
        return y
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    if cfg.persistent and _tma_ready(a, w):
        from triton.tools.tensor_descriptor import TensorDescriptor

        programs = min(tiles, _processors(a.device))
        _tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]),
            a_scale, w_scale, res, y, m, n, k, programs,
            res.stride(0), res.stride(1), y.stride(0), y.stride(1),
            HAS_RES=residual is not None, OUT_BF16=out_dtype == torch.bfloat16,
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
            EPI=cfg.epilogue_split, WS=cfg.warp_specialize,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
        )  # fmt: skip
        return y
    grid = (tiles,)
    _kernel[grid](
        a, w, a_scale, w_scale, res, y,
        m, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1),
        res.stride(0), res.stride(1), y.stride(0), y.stride(1),
        HAS_RES=residual is not None, OUT_BF16=out_dtype == torch.bfloat16, EVEN_K=k % cfg.block_k == 0,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, EPI=cfg.epilogue_split,
        SWIGLU=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )  # fmt: skip
    return y


def int8_gemm_swiglu(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    backend: Backend = "auto",
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """v [M, I] fp32 = silu(gate) * up of the stacked GEMM y = int8_gemm(a, w, a_scale, w_scale),
    gate = y[:, 0::2] and up = y[:, 1::2]; w int8 [2I, K] the MLP's interleaved gate+up weight
    (`gate_up.interleave_gate_up`: row 2j gate j, row 2j + 1 up j), w_scale fp32 [2I] likewise.

    Why: the unfused path writes y (fp32 [M, 2I]: 1.14 GB a layer at the 27B's 8,192 rows) and
    `swiglu_quantize` reads it back; here the epilogue combines each gate column with its up
    column, so half the bytes are written, and `quantize_rows(v, smooth)` reads half as many.
    Each gate and up value is the plain GEMM's (the same exact int32 sum, the same epilogue
    steps) and v is `swiglu_quantize`'s own expression on them, so `quantize_rows(v, smooth)`
    equals `swiglu_quantize(y, smooth)` bit for bit.

    `config` (a tile config: block_n output columns, 2 * block_n weight rows a tile) overrides
    `swiglu_config_for(M)`; where that is None (M keeps the unfused path) this still runs, with
    SWIGLU_SMALL, so the function works at any M. "auto" on Hopper with the CUTLASS library hands
    the M buckets its table serves from `cutlass_gemm.SWIGLU_MIN_ROWS` to its one-GEMM form
    (`Library.swiglu_pairs`: the same bits).
    CPU without backend="triton": torch ops (to rounding: `int8_gemm_swiglu_reference`).
    """
    _check_pairs(w)
    _check(a, w, a_scale, w_scale, None, torch.float32)
    m, k = a.shape
    n = w.shape[0] // 2
    if not use_triton(backend, a) or m == 0 or n == 0 or k == 0:
        return int8_gemm_swiglu_reference(a, w, a_scale, w_scale)
    if m * k >= 2**31 or 2 * n * k >= 2**31 or m * n >= 2**31:
        raise ValueError(f"int8_gemm_swiglu shape {m}x{k}x{2 * n} exceeds 32-bit indexing")
    pairs = _pairs_form(a, w) if config is None and backend == "auto" else None
    if pairs is not None:  # one CUTLASS GEMM: gate and up paired in its epilogue, v stored
        library, name = pairs
        v = torch.empty(m, n, dtype=torch.float32, device=a.device)
        library.swiglu_pairs(name, a, w, a_scale, w_scale, v)
        return v
    cfg = config or swiglu_config_for(m) or SWIGLU_SMALL
    if cfg.gemv or cfg.split_k > 1 or cfg.stream_k or cfg.persistent:
        raise ValueError(f"int8_gemm_swiglu runs tile configs only, got {cfg}")
    y = torch.empty(m, n, dtype=torch.float32, device=a.device)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    _kernel[(tiles,)](
        a, w, a_scale, w_scale, y, y,
        m, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1),
        y.stride(0), y.stride(1), y.stride(0), y.stride(1),
        HAS_RES=False, OUT_BF16=False, EVEN_K=k % cfg.block_k == 0,
        BM=cfg.block_m, BN=2 * cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m, EPI=1,
        SWIGLU=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )  # fmt: skip
    return y
