"""W8A8 int8 linears with SmoothQuant: the int8 precision path's arithmetic.

Weights are int8 per output channel (symmetric, scale = row absmax / 127); activations are
quantized per token (per row) the same way when a linear runs. The product of the two int8
matrices accumulates exactly in int32 (|acc| <= K * 127^2 < 2^31 for any K up to 133k), so
it does not depend on tiling, on how many rows the call had, or on the device's GEMM
algorithm. Everything after the integer product is one fixed fp32 sequence,

    y = (acc.float() * act_scale[:, None]) * w_scale[None, :]

made of correctly rounded multiplies only, so a row's output depends on that row alone.
The per-row quantization is batch invariant for the same reason: the absmax is exact under
any reduction order, and division, rounding (half to even) and clamping are exact per element.

SmoothQuant (Xiao et al. 2023) migrates activation outliers into the weights before
quantizing: per input channel j, s_j = max|X_j|^a / max|W_j|^(1-a) over the calibration
activations X and every weight W that reads that input; X' = X / s, W' = W * s (columns).
Where the input comes straight out of an RMSNorm the division is folded into the norm weight
(`fold_smoothing`); elsewhere the linear divides its input by s before quantizing
(`QuantLinear.smooth`). a = 0 means no smoothing at all (plain per-token int8).

Integer GEMM backends (`int8_matmul`), all giving the identical int32 result:
- CUDA: `torch._int_mm` when M > 16 and K, N are multiples of 8; otherwise the operands are
  zero-padded to meet those rules (extra zero rows/columns add nothing) and the result sliced.
- CPU: `torch._int_mm` too (measured on a 2-core x86 host, torch 2.15: 0.23 s vs 0.74 s for a
  float64 matmul of int8-valued tensors at M=300, K=64, N=248320; 24 ms vs 55 ms at M=256,
  K=1024, N=3584; float64 wins only for tiny shapes, by microseconds), with the float64 path
  (exact while |sums| < 2^53) as a fallback where `_int_mm` is missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from engine import kernels
from engine.kernels._triton import HAVE_TRITON

INT8_MAX = 127
# SmoothQuant scales are kept in a range where neither the folded weights nor x / s can
# overflow or flush to zero in fp32.
SMOOTH_MIN, SMOOTH_MAX = 1e-4, 1e4

GemmImpl = Literal["auto", "int_mm", "padded", "float64"]


# ------------------------------------------------------------------------ quantization
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row of x [..., K]: (q int8 [..., K], scale fp32 [...]) with x ~ q * scale.

    scale = absmax / 127; q = clamp(round_half_even(x / scale), -127, 127). An all-zero row
    gets scale 0 and q 0.
    """
    xf = x.float()
    return quantize_rows_given_absmax(xf, xf.abs().amax(dim=-1))


def quantize_rows_given_absmax(x: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` with each row's absmax supplied (tensor parallelism reduces it across ranks).

    The same operations as the GPU kernel (`engine.kernels.quant`): the scale divides by a
    tensor 127, never the Python number (CUDA would multiply by a rounded reciprocal instead).
    """
    scale = absmax / torch.full_like(absmax, float(INT8_MAX))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x.float() / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


# ------------------------------------------------------------------------ integer GEMM
def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _int_mm_padded(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """`torch._int_mm` with zero padding to its CUDA shape rules (M > 16, K and N multiples of 8)."""
    m, k = a.shape
    n = b_t.shape[0]
    mp, kp, np_ = max(m, 17), _round_up(k, 8), _round_up(n, 8)
    if (mp, kp) != (m, k):
        a = torch.nn.functional.pad(a, (0, kp - k, 0, mp - m))
    if (np_, kp) != (n, k):
        b_t = torch.nn.functional.pad(b_t, (0, kp - k, 0, np_ - n))
    return torch._int_mm(a, b_t.t())[:m, :n]


def _float64_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    # Every product and partial sum is an integer below 2^53 in magnitude: exact in float64.
    return (a.double() @ b_t.double().t()).to(torch.int32)


def int8_matmul(a: torch.Tensor, b_t: torch.Tensor, impl: GemmImpl = "auto") -> torch.Tensor:
    """Exact int32 product a @ b_t.T of int8 a [M, K] and int8 b_t [N, K] (weights stay [out, in]).

    `impl` forces a backend (tests compare them). "auto" on CUDA takes `_int_mm` directly where
    its shape rules allow, else the padded call. On CPU it takes the float64 product, which is
    exact by construction on any CPU: torch's CPU `_int_mm` goes through oneDNN, whose s8s8
    GEMM without VNNI returned wrong sums (torch 2.15 with ONEDNN_MAX_CPU_ISA=AVX2, AVX512_CORE
    or SSE41 on a VNNI machine; a CPU without VNNI, e.g. Skylake or Zen 2/3, would run those
    kernels too - not measured on one).
    """
    if a.dtype != torch.int8 or b_t.dtype != torch.int8:
        raise ValueError(f"int8_matmul takes int8 operands, got {a.dtype} and {b_t.dtype}")
    if a.dim() != 2 or b_t.dim() != 2 or a.shape[1] != b_t.shape[1]:
        raise ValueError(f"int8_matmul needs [M, K] and [N, K], got {tuple(a.shape)} and {tuple(b_t.shape)}")
    m, k = a.shape
    n = b_t.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=torch.int32, device=a.device)
    if impl == "float64":
        return _float64_mm(a, b_t)
    if impl == "padded":
        return _int_mm_padded(a, b_t)
    if impl == "int_mm":
        return torch._int_mm(a, b_t.t())
    if impl != "auto":
        raise ValueError(f"impl must be auto, int_mm, padded or float64, got {impl!r}")
    if not hasattr(torch, "_int_mm") or a.device.type == "cpu":
        return _float64_mm(a, b_t)
    if m > 16 and k % 8 == 0 and n % 8 == 0:
        return torch._int_mm(a.contiguous(), b_t.t())
    return _int_mm_padded(a.contiguous(), b_t)


# ------------------------------------------------------------------------ the linear
@dataclass
class QuantLinear:
    """An int8 linear `y = x @ W.T` as the executor calls it: `QuantLinear(...)(x)`.

    qweight [N, K] int8 and w_scale [N] fp32 hold W * diag(s) quantized per output channel;
    smooth [K] (or None) is the SmoothQuant s the input is divided by before quantizing, when
    it could not be folded into a preceding norm.
    """

    qweight: torch.Tensor
    w_scale: torch.Tensor
    smooth: torch.Tensor | None = None

    @classmethod
    def from_float(cls, weight: torch.Tensor, smooth: torch.Tensor | None = None) -> QuantLinear:
        """Quantize a float weight [N, K]; with `smooth`, W * s is quantized and x / s applied at run time."""
        w = weight.float()
        if smooth is not None:
            w = w * smooth.float()[None, :]
        q, scale = quantize_rows(w)
        return cls(q, scale, None if smooth is None else smooth.float().clone())

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.w_scale] + ([self.smooth] if self.smooth is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device | str) -> QuantLinear:
        smooth = None if self.smooth is None else self.smooth.to(device)
        return QuantLinear(self.qweight.to(device), self.w_scale.to(device), smooth)

    def dequantized(self) -> torch.Tensor:
        """The float weight this linear computes with, in the input's original (unsmoothed) basis."""
        w = dequantize_rows(self.qweight, self.w_scale)
        return w if self.smooth is None else w / self.smooth[None, :]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.qweight.shape
        if x.shape[-1] != k:
            raise ValueError(f"QuantLinear expects inputs with {k} features, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        if x.is_cuda and HAVE_TRITON:
            # GPU: one quantization kernel and one GEMM with the same epilogue fused (engine.kernels)
            q, act_scale = kernels.quantize_rows(x.reshape(-1, k), self.smooth)
            return kernels.int8_gemm(q, self.qweight, act_scale, self.w_scale).reshape(*lead, n)
        x2 = x.reshape(-1, k).float()
        if self.smooth is not None:
            x2 = x2 / self.smooth
        q, act_scale = quantize_rows(x2)
        # The one fixed epilogue order: row scale first, then column scale, fp32.
        return kernels.scale_int32(int8_matmul(q, self.qweight), act_scale, self.w_scale).reshape(*lead, n)


@dataclass
class SmoothedLinear:
    """The float linear `(x / s) @ (W * s).T`: a smoothed, not yet quantized, explicit-smoothing linear.

    Exists so that the smoothed model can be run in fp32 and checked against the original.
    """

    weight: torch.Tensor  # W * diag(s), [N, K]
    smooth: torch.Tensor  # s, [K]

    def to(self, device: torch.device | str) -> SmoothedLinear:
        return SmoothedLinear(self.weight.to(device), self.smooth.to(device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x / self.smooth.to(x.dtype)) @ self.weight.to(x.dtype).T


def quantize_linear(weight: torch.Tensor | SmoothedLinear) -> QuantLinear:
    """A float weight [N, K] (or a smoothed linear, keeping its s) as an int8 `QuantLinear`."""
    if isinstance(weight, SmoothedLinear):
        q, scale = quantize_rows(weight.weight)
        return QuantLinear(q, scale, weight.smooth.float())
    return QuantLinear.from_float(weight)


def is_quantized(weight: object) -> bool:
    return isinstance(weight, QuantLinear)


# ------------------------------------------------------------------------ SmoothQuant
def smooth_scales(
    act_absmax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float
) -> torch.Tensor | None:
    """SmoothQuant s [K]: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha), W_j over every weight given.

    Returns None for alpha == 0 (no smoothing). Channels that never activated or whose weight
    column is all zero keep s = 1; s is clamped to [1e-4, 1e4].
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    if alpha == 0.0:
        return None
    if not weights:
        raise ValueError("smooth_scales needs at least one weight")
    a = act_absmax.double()
    w = torch.stack([t.double().abs().amax(dim=0) for t in weights]).amax(dim=0)
    if w.shape != a.shape:
        raise ValueError(f"activation stats have {a.shape[0]} channels, weights {w.shape[0]} inputs")
    live = (a > 0) & (w > 0)
    s = torch.where(live, a.clamp(min=1e-30).pow(alpha) / w.clamp(min=1e-30).pow(1.0 - alpha), 1.0)
    return s.clamp(SMOOTH_MIN, SMOOTH_MAX).float()


def fold_smoothing(
    norm_weight: torch.Tensor, weights: Sequence[torch.Tensor], s: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Fold s into an RMSNorm feeding `weights`: (norm / s, [W * s for each W]); exact maths unchanged."""
    s = s.float()
    return norm_weight.float() / s, [w.float() * s[None, :] for w in weights]
