"""RoPE rows by position (engine.run.rope): against scalar libm, and a position's bits whatever the batch."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.run.rope import ROPE_BLOCK, rope_rows, rope_table
from engine.testing.make_model import dims_config


def _config(theta: float):
    # a theta of its own: the process-wide table for it starts empty in this test
    return dataclasses.replace(dims_config("tiny"), rope_theta=theta)


def test_rows_match_scalar_libm_to_fp32_rounding() -> None:
    cfg = _config(12_345.0)
    rd = cfg.rope_dims
    positions = torch.tensor([0, 1, 7, ROPE_BLOCK - 1, ROPE_BLOCK, 3 * ROPE_BLOCK + 5, 40_000])
    cos, sin = rope_rows(cfg, positions, torch.float32)
    assert cos.shape == sin.shape == (len(positions), rd) and cos.dtype == torch.float32
    for r, p in enumerate(positions.tolist()):
        for i in range(rd):
            angle = p * (1.0 / cfg.rope_theta ** ((2 * (i % (rd // 2))) / rd))
            # fp64 libm values rounded once to fp32: within half an fp32 ulp plus fp64 noise
            assert abs(cos[r, i].item() - math.cos(angle)) <= 2**-24 * abs(math.cos(angle)) + 1e-12
            assert abs(sin[r, i].item() - math.sin(angle)) <= 2**-24 * abs(math.sin(angle)) + 1e-12


def test_a_position_has_the_same_bits_in_any_batch_and_after_the_table_grows() -> None:
    cfg = _config(54_321.0)
    g = torch.Generator().manual_seed(5)
    alone = {p: rope_rows(cfg, torch.tensor([p]), torch.float32) for p in (3, 1000, ROPE_BLOCK + 17)}
    batch = torch.randint(0, 3 * ROPE_BLOCK, (500,), generator=g)  # grows the table past its blocks
    batch[[11, 222, 433]] = torch.tensor(list(alone))
    cos, sin = rope_rows(cfg, batch, torch.float32)
    for row, p in zip((11, 222, 433), alone, strict=True):
        assert torch.equal(cos[row], alone[p][0][0]) and torch.equal(sin[row], alone[p][1][0])
    again = rope_rows(cfg, batch.flip(0), torch.float32)
    assert torch.equal(again[0], cos.flip(0)) and torch.equal(again[1], sin.flip(0))


def test_other_dtypes_are_rounded_once_from_fp64() -> None:
    cfg = _config(777.0)
    positions = torch.arange(0, 300, 7)
    wide = rope_rows(cfg, positions, torch.float64)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        narrow = rope_rows(cfg, positions, dtype)
        assert torch.equal(narrow[0], wide[0].to(dtype)) and torch.equal(narrow[1], wide[1].to(dtype))


def test_bad_positions_are_named() -> None:
    cfg = _config(999.0)
    with pytest.raises(ValueError, match="1-D"):
        rope_rows(cfg, torch.zeros(2, 2, dtype=torch.int64), torch.float32)
    with pytest.raises(ValueError, match=">= 0"):
        rope_rows(cfg, torch.tensor([3, -1]), torch.float32)
    empty = rope_rows(cfg, torch.zeros(0, dtype=torch.int64), torch.float32)
    assert empty[0].shape == (0, cfg.rope_dims)


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_the_device_table_holds_the_host_rows_and_grows_by_replacement(device: str) -> None:
    """`rope_table` is what the one-pass body gathers a pass's RoPE rows from: bit for bit
    `rope_rows`' fp32 values, at every position it covers, before and after it grows."""
    cfg = _config(31_415.0)
    small = rope_table(cfg, 10, device)
    assert small.shape == (ROPE_BLOCK, 2, cfg.rope_dims) and small.dtype == torch.float32
    assert small.device.type == device
    assert rope_table(cfg, ROPE_BLOCK, device) is small  # covered: the same tensor
    big = rope_table(cfg, 2 * ROPE_BLOCK + 1, device)
    assert big.shape[0] == 3 * ROPE_BLOCK and big is not small
    positions = torch.tensor([0, 1, 17, ROPE_BLOCK - 1, ROPE_BLOCK, 2 * ROPE_BLOCK, 3 * ROPE_BLOCK - 1])
    cos, sin = rope_rows(cfg, positions, torch.float32)
    rows = big.index_select(0, positions.to(device)).cpu()
    assert torch.equal(rows[:, 0], cos) and torch.equal(rows[:, 1], sin)
    assert torch.equal(small.cpu(), big[:ROPE_BLOCK].cpu())  # the old table stays valid and equal
    with pytest.raises(ValueError, match=">= 0"):
        rope_table(cfg, -1, device)
