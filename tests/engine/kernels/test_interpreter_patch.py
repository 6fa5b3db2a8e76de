"""`engine.kernels._triton.reuse_the_launchs_language_patch`: under Triton's interpreter, helpers
called inside a launch reuse the launch's patch of `triton.language` instead of patching it
again. Oracle: the same launches with triton's own patching, and the torch references."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.kernels import _triton
from engine.kernels.quant import (
    quantize_rows,
    quantize_rows_reference,
    rms_norm_quantize,
    rms_norm_quantize_reference,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="compiled kernels: no interpreter")


def _skip_without_the_reuse() -> None:
    """A triton whose interpreter lacks the functions the reuse wraps keeps its own patching (a
    speed, not a promise): nothing to compare there."""
    if not _triton.reuse_the_launchs_language_patch(True):
        pytest.skip("this triton's interpreter has no `_patch_lang` / `GridExecutor.__call__` to wrap")


@pytest.fixture
def counted_patches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times triton's own `_patch_lang` runs, with launches patching as triton does
    (`REUSE_LANGUAGE_PATCH` off) until the test turns the reuse on."""
    from triton.runtime import interpreter

    _skip_without_the_reuse()
    _triton.reuse_the_launchs_language_patch(False)
    calls = [0]
    own = interpreter._patch_lang

    def counting(fn: object) -> object:
        calls[0] += 1
        return own(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    monkeypatch.setattr(_triton, "REUSE_LANGUAGE_PATCH", False)
    yield calls
    _triton.reuse_the_launchs_language_patch(False)  # triton's own back before the undo
    monkeypatch.undo()


def _launches(gen: torch.Generator) -> list[torch.Tensor]:
    """Kernels whose helpers are ours (`_round_int8`, `_row_value`) and triton's (`tl.zeros`,
    `tl.sum`, which see `tl.core`): the norm in registers, a plain row with a divisor, and the
    long-row kernel past 16,384 values."""
    x = torch.randn(3, 200, generator=gen) * 4
    x[:, ::17] *= 20
    weight = torch.rand(200, generator=gen) + 0.5
    divisor = torch.rand(200, generator=gen) + 0.5
    long_rows = torch.randn(2, 16500, generator=gen)
    got = [*rms_norm_quantize(x, weight, 1e-6, backend="triton")]
    got += [*quantize_rows(x, divisor, backend="triton")]
    got += [*quantize_rows(long_rows, backend="triton")]
    want = [*rms_norm_quantize_reference(x, weight, 1e-6), *quantize_rows_reference(x, divisor)]
    want += [*quantize_rows_reference(long_rows)]
    # the plain rows equal torch's; the fused norm sums its squares in another order (~1 ulp), so
    # its scale agrees to that and a code may sit one int8 step away (test_kernel_quant's bounds)
    assert torch.allclose(got[1], want[1], rtol=1e-6, atol=0)
    assert int((got[0].int() - want[0].int()).abs().max()) <= 1
    for g, w in zip(got[2:], want[2:], strict=True):
        assert torch.equal(g, w)
    return got


def test_reusing_the_launchs_patch_gives_the_bits_of_patching_at_every_helper(
    counted_patches: list[int],
) -> None:
    own = _launches(torch.Generator().manual_seed(5))
    patches_own = counted_patches[0]
    counted_patches[0] = 0
    _triton.REUSE_LANGUAGE_PATCH = True  # the fixture's monkeypatch puts the flag back
    reused = _launches(torch.Generator().manual_seed(5))
    for a, b in zip(own, reused, strict=True):
        assert torch.equal(a, b)
    # three launches: each patches once for itself and at most once more, for a helper that sees
    # `tl.core`; triton's own patching runs again at every helper call of every program
    assert 3 <= counted_patches[0] <= 6 < patches_own


def test_putting_triton_back_restores_its_own_functions() -> None:
    from triton.runtime import interpreter

    _skip_without_the_reuse()
    _launches(torch.Generator().manual_seed(6))  # a launch keeps the reuse in force
    assert _triton.reuse_the_launchs_language_patch(True)
    wrapped = interpreter._patch_lang
    _triton.reuse_the_launchs_language_patch(False)
    own = interpreter._patch_lang
    assert own is not wrapped and own.__module__ == interpreter.__name__
    assert _triton.reuse_the_launchs_language_patch(True)
    assert interpreter._patch_lang is not own
