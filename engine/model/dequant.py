"""Vectorised torch dequantisation of ggml tensor bytes to float32.

Each decoder follows gguf-py's numpy reference operation for operation (same products, same
order, float32 throughout), so the result is bitwise equal to `gguf.quants.dequantize`; the
tests hold it to that. Works on CPU or GPU tensors; large tensors are decoded in chunks of
blocks so the temporaries stay a bounded multiple of the chunk, not of the tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
QK_K = 256
CHUNK_ELEMENTS = 1 << 22


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] little-endian fp16 bytes -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split each `group`-byte run into its low nibbles then its high nibbles: [n, g*group] ->
    [n, g, 2, group]."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return (qs >> shifts) & 0x0F


def _bits(b: torch.Tensor, stride: int, count: int, mask: int) -> torch.Tensor:
    """Fields of `stride` bits: [n, m] -> [n, count, m] with field i = (b >> stride*i) & mask."""
    shifts = torch.arange(0, stride * count, stride, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(1) >> shifts.reshape(1, count, 1)) & mask


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    x = b[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], -1).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], -1).float()
    return d * q + m


def _q5_low_high(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 quants: bit i of the little-endian uint32 `qh` is the 5th bit of value i."""
    n = qs.shape[0]
    high = _bits(qh, 1, 8, 1).transpose(1, 2).reshape(n, 32)  # byte j, bit k -> value 8j+k
    low = _nibbles(qs, 16).reshape(n, 32)
    return low | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _q5_low_high(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _q5_low_high(b[:, 4:8], b[:, 8:]).float()
    return d * q + m


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12 bytes of eight 6-bit (scale, min) pairs shared by Q4_K and Q5_K."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (d * sc.float()).reshape(n, 8, 1)
    dm = (dmin * mn.float()).reshape(n, 8, 1)
    low = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    high = _bits(b[:, 16:48], 1, 8, 1)  # sub-block i takes bit i of each qh byte
    q = (low | (high << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    d = (d * scales).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    high = _bits(qh.reshape(n * 2, 32), 2, 4, 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _f16_all(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32,
    Q.F16: _f16_all,
    Q.BF16: _bf16,
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DECODERS)


class UnsupportedTypeError(ValueError):
    pass


def numpy_bytes(array: np.ndarray) -> torch.Tensor:
    """Flat uint8 torch view of a numpy array's bytes, without a copy when it is contiguous.

    Read-only arrays (a read-only file map) are accepted: torch warns that it cannot guard
    writes, and nothing here writes to them.
    """
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(flat)


def dequantize(
    raw: torch.Tensor | np.ndarray,
    ggml_type: GGMLQuantizationType | int,
    shape: Sequence[int],
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Decode ggml bytes (any shape, uint8, C-contiguous) into a float32 tensor of `shape`.

    `shape` is in torch order (last dim = ggml row). Raises UnsupportedTypeError for types
    without a decoder and ValueError when the byte count does not match `shape`.
    """
    qtype = GGMLQuantizationType(ggml_type)
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedTypeError(f"unsupported ggml type {qtype.name} (supported: {supported})")
    block, type_size = GGML_QUANT_SIZES[qtype]
    n_elements = int(np.prod(shape, dtype=np.int64))
    if n_elements % block:
        raise ValueError(f"{qtype.name}: {n_elements} elements are not whole blocks of {block}")
    n_blocks = n_elements // block
    if isinstance(raw, np.ndarray):
        raw = numpy_bytes(raw)
    if raw.dtype != torch.uint8:
        raise ValueError(f"dequantize expects uint8 bytes, got {raw.dtype}")
    if raw.numel() != n_blocks * type_size:
        raise ValueError(f"{qtype.name} {tuple(shape)} needs {n_blocks * type_size} bytes, got {raw.numel()}")
    blocks = raw.reshape(n_blocks, type_size)
    if device is not None:
        blocks = blocks.to(device)
    out = torch.empty(n_blocks, block, dtype=torch.float32, device=blocks.device)
    chunk = max(1, CHUNK_ELEMENTS // block)
    for start in range(0, n_blocks, chunk):
        stop = min(start + chunk, n_blocks)
        out[start:stop] = decoder(blocks[start:stop])
    return out.reshape(tuple(shape))
