"""Row norms: close to the torch formula, and a row's bits never depend on the batch, nor on
which of the two kernels (row held in registers, or read twice) runs it."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.norm import norm_rows, norm_rows_reference

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # CPU runs the kernel interpreted


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("k", [16, 100, 128, 10240])  # 10,240: past 8,192, the long-row kernel
def test_matches_reference_and_is_batch_invariant(device: str, mean: bool, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(37, k, generator=g) * 3).to(device)
    w = (torch.rand(k, generator=g) + 0.5).to(device)
    weight = w if mean else None
    y = norm_rows(x, weight, 1e-6, mean=mean, backend="triton")
    ref = norm_rows_reference(x, weight, 1e-6, mean)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6)
    for rows in (1, 5, 36):
        part = norm_rows(x[rows - 1 : rows + 1], weight, 1e-6, mean=mean, backend="triton")
        assert torch.equal(part, y[rows - 1 : rows + 1])


def test_keeps_leading_dims_and_checks_weight() -> None:
    x = torch.randn(3, 4, 16, device=DEVICES[0])
    y = norm_rows(x, None, 1e-6, mean=False, backend="triton")
    assert y.shape == x.shape
    assert torch.allclose(y.norm(dim=-1), torch.ones(3, 4, device=x.device), atol=1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        norm_rows(x, torch.ones(5, device=x.device), 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("k", [100, 128, 5000, 10240])  # up to three blocks of 4,096, the last ragged
def test_resident_and_long_row_kernels_give_the_same_bits(
    device: str, mean: bool, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row held in registers gives the bits of a row read twice: same block and warps, so
    the same order of the sum of squares (the torch reference only bounds it)."""
    import engine.kernels.norm as kn

    g = torch.Generator().manual_seed(k + mean)
    x = torch.randn(6, k, generator=g) * 3
    x[2] = 0.0
    if k > 2 * 4096:  # a lane's squares summed over 3 blocks: only block order gives 1
        x[3] = 0.0
        x[3, 0] = 1.0
        x[3, 4096::4096] = 2.0**-12  # 1 + 2^-24 + 2^-24 rounds to 1 in order, else 1 + 2^-23
    x = x.to(device)
    w = (torch.rand(k, generator=g) + 0.5).to(device)
    weight = w if mean else None
    monkeypatch.setattr(kn, "RESIDENT_VALUES", 64)  # every k here held in registers
    y_res = norm_rows(x, weight, 1e-6, mean=mean, backend="triton")
    monkeypatch.setattr(kn, "RESIDENT_VALUES", 0)  # none: the long-row kernel
    y_long = norm_rows(x, weight, 1e-6, mean=mean, backend="triton")
    assert torch.equal(y_res, y_long)
    assert not y_res[2].any()
