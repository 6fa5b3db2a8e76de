"""A pool of fp32 state blocks for the kernel tests: one tensor, so torch references can view the
blocks the kernels address as offsets from its start."""

from __future__ import annotations

import torch


class Pool:
    """One fp32 tensor holding every block; `take` hands out aligned offsets into it."""

    def __init__(self, n: int, dev: torch.device, gen: torch.Generator) -> None:
        self.base = torch.randn(n, generator=gen).to(dev)
        self.used = 0

    def take(self, n: int) -> int:
        off = self.used
        self.used += (n + 3) // 4 * 4
        assert self.used <= self.base.numel()
        return off
