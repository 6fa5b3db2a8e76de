"""int8 x int8 GEMM with exact int32 accumulation and a fused, fixed-order fp32 epilogue.

    y = (acc.float() * a_scale[m]) * w_scale[n]   (+ residual[m, n])   -> fp32 or bf16

`acc` is the exact integer product of a [M, K] and the weight w [N, K] (kept [out, in]; the
kernel reads its column-major view). Integer sums are exact (|acc| <= K * 127^2 < 2^31 for
K < 133,000), so the tile config cannot change a single bit: configs are picked from a fixed
table by M for speed only, never by timing. The epilogue is elementwise in one fixed order,
compiled without FMA contraction, so row m of y depends on row m of a alone - the int8
path's batch-invariance contract - and equals the torch reference below bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels._triton import Backend, cdiv, helper, kernel, use_triton

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
    split_k: int = 1  # > 1: K split over programs whose exact int32 partials are added atomically
    persistent: bool = False  # one program per SM walking tiles, operands by TMA (sm_90+)


# (largest M, config): fixed, so a given M always runs the same program. Measured on an H200
# (ops/bench/NOTES-kernels.md); any entry gives identical bits.
CONFIG_TABLE: tuple[tuple[int, GemmConfig], ...] = (
    (64, GemmConfig(64, 128, 128, 4, 4)),
    (512, GemmConfig(64, 128, 128, 4, 4)),
    (1 << 62, GemmConfig(128, 128, 128, 8, 3)),
)


def config_for(m: int) -> GemmConfig:
    for max_m, cfg in CONFIG_TABLE:
        if m <= max_m:
            return cfg
    return CONFIG_TABLE[-1][1]


def _int8_gemm_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    # grouped tile order: GROUP_M row-tiles share each weight column-tile while it is in L2
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    # rows/cols past the edge re-read row/col 0 instead of masking; they are never stored
    rows = tl.where(offs_m < M, offs_m, 0)
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

    _epilogue(
        acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
        stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
    )  # fmt: skip


def _int8_gemm_tma_kernel(
    a_desc, w_desc, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
    M, N, K, num_programs, stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    """Persistent: program p computes tiles p, p + num_programs, ... in the grouped order of
    `_int8_gemm_kernel`; operand tiles come by TMA (tensor descriptors), whose reads past an
    edge are zeros, so no masks. Each tile's int32 sum and epilogue are the other kernel's."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    for tile in tl.range(tl.program_id(0), num_m * num_n, num_programs):
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
        offs_n = pid_n * BN + tl.arange(0, BN)
        _epilogue(
            acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
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


def _int8_partial_kernel(
    a_ptr, w_ptr, ws_ptr, M, N, K, k_per_split,
    stride_am, stride_ak, stride_wn, stride_wk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ON_GPU: tl.constexpr,
):  # fmt: skip
    """Split-K: program (tile, split) adds the exact int32 product over its K slice into ws."""
    num_n = tl.cdiv(N, BN)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    k0 = tl.program_id(1) * k_per_split
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    rows = tl.where(offs_m < M, offs_m, 0)
    cols = tl.where(offs_n < N, offs_n, 0)
    a_ptrs = a_ptr + rows[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
    acc = tl.zeros((BM, BN), dtype=tl.int32)
    for kb in range(0, tl.cdiv(k_per_split, BK)):
        rem = tl.minimum(K - k0, k_per_split) - kb * BK
        a = tl.load(a_ptrs, mask=offs_k[None, :] < rem, other=0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < rem, other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BK * stride_ak
        w_ptrs += BK * stride_wk
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.atomic_add(ws_ptr + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)  # integers: exact


def _int32_epilogue_kernel(
    ws_ptr, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr, M, N,
    stride_rm, stride_rn, stride_ym, stride_yn,
    HAS_RES: tl.constexpr, OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ON_GPU: tl.constexpr,
):  # fmt: skip
    num_n = tl.cdiv(N, BN)
    offs_m = (tl.program_id(0) // num_n) * BM + tl.arange(0, BM)
    offs_n = (tl.program_id(0) % num_n) * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.load(ws_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0)
    _epilogue(
        acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, res_ptr, y_ptr,
        stride_rm, stride_rn, stride_ym, stride_yn, HAS_RES, OUT_BF16, ON_GPU,
    )  # fmt: skip


_epilogue = helper(_epilogue)  # type: ignore[assignment]
_kernel = kernel(_int8_gemm_kernel)
_tma_kernel = kernel(_int8_gemm_tma_kernel)
_partial = kernel(_int8_partial_kernel)
_finish = kernel(_int32_epilogue_kernel)


def _tma_ready(a: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs unit inner strides, 16-byte aligned rows and bases, and on CUDA sm_90+;
    otherwise the persistent config falls back to the pointer kernel (the same bits)."""
    for x in (a, w):
        if x.stride(1) != 1 or x.stride(0) % 16 or x.data_ptr() % 16:
            return False
    return not a.is_cuda or torch.cuda.get_device_capability(a.device)[0] >= 9


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
    `config` overrides the fixed table (benchmarks only; the bits are the same).
    """
    _check(a, w, a_scale, w_scale, residual, out_dtype)
    m, k = a.shape
    n = w.shape[0]
    if not use_triton(backend, a) or m == 0 or n == 0 or k == 0:
        return int8_gemm_reference(a, w, a_scale, w_scale, residual, out_dtype)
    if m * k >= 2**31 or n * k >= 2**31 or m * n >= 2**31:
        raise ValueError(f"int8_gemm shape {m}x{k}x{n} exceeds 32-bit indexing")
    cfg = config or config_for(m)
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    res = residual if residual is not None else y
    if cfg.split_k > 1:
        # exact int32 partial sums added atomically (any order: the same integers), then the epilogue
        ws = torch.zeros(m, n, dtype=torch.int32, device=a.device)
        k_per = cdiv(cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
        _partial[(tiles, cdiv(k, k_per))](
            a, w, ws, m, n, k, k_per, a.stride(0), a.stride(1), w.stride(0), w.stride(1),
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        _finish[(tiles,)](
            ws, a_scale, w_scale, res, y, m, n, res.stride(0), res.stride(1), y.stride(0), y.stride(1),
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
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
    )  # fmt: skip
    return y
