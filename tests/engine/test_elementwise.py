"""engine.run.elementwise: CPU activations whose bits do not depend on an element's position.

Oracles: the same function over the whole tensor (position independence: every element is
also evaluated inside tensors of many other sizes, which moves it between torch's vectorized
body and scalar tail), and float64 torch (accuracy).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.run import elementwise

FUNCTIONS = {
    "sigmoid": (elementwise.sigmoid, torch.sigmoid),
    "silu": (elementwise.silu, F.silu),
    "softplus": (elementwise.softplus, F.softplus),
}


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6000, generator=g) * 8
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 19.99, 20.0, 20.01, -87.0, 88.0, -200.0, 200.0])
    return torch.cat([wide, edges])


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_bits_do_not_depend_on_where_an_element_sits(name: str) -> None:
    fn, _ = FUNCTIONS[name]
    x = _inputs()
    whole = fn(x)
    for size in (1, 3, 7, 15, 16, 17, 31, 33, 100):
        pieces = torch.cat([fn(x[i : i + size].clone()) for i in range(0, x.numel(), size)])
        assert torch.equal(pieces, whole), (name, size)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_accuracy_against_float64(name: str) -> None:
    fn, ref = FUNCTIONS[name]
    x = _inputs()
    exact = ref(x.double())
    got = fn(x).double()
    # a few fp32 rounding steps: within 4 ulp of the float64 value, relative to it
    tol = 4 * torch.finfo(torch.float32).eps * exact.abs() + torch.finfo(torch.float32).tiny
    assert bool(((got - exact).abs() <= tol).all()), name
