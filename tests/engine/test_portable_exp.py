"""The sampler's portable exp and draw (`engine.decide.portable_exp`, `engine.decide.sampling._draw`).

Two independent oracles: e^x to 50 digits (`decimal`), which bounds the error; and the same
sequence of operations in exact rational arithmetic, each result rounded once to the nearest
float64 (`fractions.Fraction`, whose conversion to float rounds correctly). The second is what
"IEEE-754 basic operations only" means: it does not depend on this machine's floating point,
so equality with it is equality with what any IEEE machine (or a kernel doing the same
operations without fused multiply-adds) computes.
"""

from __future__ import annotations

import math
import random
import struct
from decimal import Decimal, localcontext
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.decide import portable_exp as pe
from engine.decide.sampling import _draw

NONPOSITIVE = st.floats(min_value=pe.FLUSH_BELOW, max_value=0.0, allow_nan=False)


def _ulps(a: float, b: float) -> int:
    def ordered(x: float) -> int:
        (i,) = struct.unpack("<q", struct.pack("<d", x))
        return i if i >= 0 else -(i & 0x7FFFFFFFFFFFFFFF)

    return abs(ordered(a) - ordered(b))


def _rounded(q: Fraction) -> Fraction:
    """q rounded to the nearest float64 (ties to even), kept exact."""
    return Fraction(float(q))


def _exp_by_rationals(x: float) -> float:
    """`portable_exp`'s operations, each rounded once to float64 by exact arithmetic."""
    fx = Fraction(x)
    n = math.floor(_rounded(_rounded(fx * Fraction(pe.INV_LN2)) + Fraction(1, 2)))
    r = _rounded(_rounded(fx - _rounded(n * Fraction(pe.LN2_HI))) - _rounded(n * Fraction(pe.LN2_LO)))
    p = Fraction(pe.TAYLOR[0])
    for c in pe.TAYLOR[1:]:
        p = _rounded(_rounded(p * r) + Fraction(c))
    return float(p * Fraction(2) ** n)


def _true_exp(x: float) -> float:
    with localcontext() as digits:
        digits.prec = 50
        return float(Decimal(x).exp())


@given(NONPOSITIVE)
def test_portable_exp_is_within_one_ulp_of_e_to_the_x(x: float) -> None:
    assert _ulps(pe.portable_exp(x), _true_exp(x)) <= 1


@given(NONPOSITIVE)
def test_portable_exp_is_its_operations_correctly_rounded(x: float) -> None:
    assert pe.portable_exp(x).hex() == _exp_by_rationals(x).hex()


def test_portable_exp_over_the_draws_range_and_its_edges() -> None:
    """Many arguments of the size a draw's weights take (l/T - max over 20 candidates), and the
    ends of the domain."""
    rng = random.Random(5)
    xs = [-rng.random() * 40 for _ in range(3000)] + [-rng.random() for _ in range(1000)]
    xs += [0.0, -0.0, -1e-300, -math.log(2), -0.5 * math.log(2), -0.5 * math.log(2) - 1e-16, -706.9]
    for x in xs:
        got = pe.portable_exp(x)
        assert got.hex() == _exp_by_rationals(x).hex(), x
        assert _ulps(got, _true_exp(x)) <= 1, x
    assert pe.portable_exp(0.0) == 1.0 and pe.portable_exp(-0.0) == 1.0
    assert pe.portable_exp(float("-inf")) == 0.0
    assert pe.portable_exp(pe.FLUSH_BELOW - 1e-9) == 0.0 and pe.portable_exp(-1e6) == 0.0
    assert pe.portable_exp(pe.FLUSH_BELOW) > 0.0
    assert math.isnan(pe.portable_exp(float("nan")))
    with pytest.raises(ValueError, match="x <= 0"):
        pe.portable_exp(1e-300)


def _draw_by_rationals(candidates: list[float], u: float, temperature: float, top_p: float) -> int:
    """The documented draw, each operation rounded once to float64 by exact arithmetic; returns
    the candidate's position."""
    t = Fraction(temperature)
    scaled = [_rounded(Fraction(v) / t) for v in candidates]
    weights = [Fraction(_exp_by_rationals(float(_rounded(s - scaled[0])))) for s in scaled]
    norm = Fraction(0)
    for w in weights:
        norm = _rounded(norm + w)
    running, total = [], Fraction(0)
    for w in weights:
        total = _rounded(total + _rounded(w / norm))
        running.append(total)
        if top_p < 1.0 and total >= Fraction(top_p):
            break
    target = _rounded(Fraction(u) * running[-1])
    return next((i for i, passed in enumerate(running) if target < passed), len(running) - 1)


@given(
    st.lists(st.floats(min_value=-60.0, max_value=60.0, allow_nan=False), min_size=1, max_size=24),
    st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
    st.sampled_from([0.05, 0.3, 0.6, 1.0, 1.7]),
    st.sampled_from([0.0, 0.5, 0.9, 0.95, 1.0]),
)
def test_the_draw_is_its_operations_correctly_rounded(
    logits: list[float], u: float, temperature: float, top_p: float
) -> None:
    """Candidates as a step's top-k gives them: fp32 logits, descending (ties included)."""
    candidates = sorted((float(struct.unpack("<f", struct.pack("<f", v))[0]) for v in logits), reverse=True)
    ids = [100 + i for i in range(len(candidates))]
    drawn = _draw(candidates, ids, u, temperature=temperature, top_p=top_p)
    assert drawn == ids[_draw_by_rationals(candidates, u, temperature, top_p)]
