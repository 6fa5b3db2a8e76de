"""RoPE cos/sin rows by absolute position, each computed once, the same way in every process.

`engine.run.reference.rope_cos_sin` evaluates cos and sin over whatever positions it is given. A
vectorized libm may round a value differently in a vector body than in its scalar tail, so
the angle of position p could depend on where p sat in that array - on what else was in the
batch. Here the fp64 rows are computed in fixed blocks of ROPE_BLOCK positions
(rope_cos_sin over [b * ROPE_BLOCK, (b + 1) * ROPE_BLOCK)) and gathered: a position's
values are a function of the position alone, in any batch, process or replay, and a long
prefill pays for its angles once instead of on every pass.

`rope_table` is the same fp32 rows on a device, [positions, 2, rope_dims] (cos, sin), copied
from this table (so bit for bit `rope_rows`): the one-pass body gathers a pass's rows from it on
the device instead of uploading them (4 MB at 8,192 rows) every pass.
"""

from __future__ import annotations

import threading

import torch

from engine.model.config import ModelConfig
from engine.run.reference import rope_cos_sin

ROPE_BLOCK = 2048

_TABLES: dict[tuple[int, float], _RopeTable] = {}
_DEVICE_TABLES: dict[tuple[int, float, torch.device], torch.Tensor] = {}
_LOCK = threading.Lock()


class _RopeTable:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.cos = torch.empty(0, config.rope_dims, dtype=torch.float64)
        self.sin = torch.empty(0, config.rope_dims, dtype=torch.float64)
        self.rounded: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def grow_to(self, positions: int) -> None:
        """Append whole blocks until the table covers positions [0, positions)."""
        have = self.cos.shape[0]
        if have >= positions:
            return
        blocks = []
        for lo in range(have, positions, ROPE_BLOCK):
            blocks.append(rope_cos_sin(self.config, torch.arange(lo, lo + ROPE_BLOCK), torch.float64))
        self.cos = torch.cat([self.cos, *(c for c, _ in blocks)])
        self.sin = torch.cat([self.sin, *(s for _, s in blocks)])
        self.rounded.clear()

    def of(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole table rounded to dtype (kept: gathering fp32 rows moves half the bytes)."""
        if dtype not in self.rounded:
            self.rounded[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self.rounded[dtype]


def _host_table(config: ModelConfig, need: int) -> _RopeTable:
    """The process-wide fp64 table of config's angles, grown to cover [0, need); call under _LOCK."""
    key = (config.rope_dims, float(config.rope_theta))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = _RopeTable(config)
    table.grow_to(need)
    return table


def rope_table(config: ModelConfig, positions: int, device: torch.device | str) -> torch.Tensor:
    """fp32 [n, 2, rope_dims] on `device` (n >= positions, whole ROPE_BLOCKs): row p holds the
    cos and sin `rope_rows(config, [p], torch.float32)` gives, copied (not recomputed), so a
    gather from it is bit for bit the host rows. Kept per device and replaced (never written)
    when it grows: a tensor returned earlier stays valid, and a gather launched from it on a
    stream reads what it read when launched."""
    if positions < 0:
        raise ValueError(f"positions must be >= 0, got {positions}")
    device = torch.device(device)
    key = (config.rope_dims, float(config.rope_theta), device)
    with _LOCK:
        table = _DEVICE_TABLES.get(key)
        if table is not None and table.shape[0] >= positions:
            return table
        host = _host_table(config, max(positions, 1))
        cos, sin = host.of(torch.float32)
        table = _DEVICE_TABLES[key] = torch.stack([cos, sin], dim=1).to(device)
        return table


def rope_rows(
    config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope_dims] of `dtype` (on the CPU) for absolute positions [T] >= 0: the
    values `rope_cos_sin` gives, each rounded once from fp64 to dtype."""
    if positions.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
    positions = positions.to("cpu", torch.int64)
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
    need = int(positions.max()) + 1 if positions.numel() else 0
    with _LOCK:
        cos, sin = _host_table(config, need).of(dtype)  # grown by replacement: these stay valid unlocked
    return cos.index_select(0, positions), sin.index_select(0, positions)
