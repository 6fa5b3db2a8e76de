"""e^x for x <= 0 from IEEE-754 basic operations only, so every machine and a GPU kernel agree.

Why: the thought sampler's weights are exp(l / T - max) (`engine.decide.sampling._draw`).
`math.exp` is the host's libm, whose last bit is not promised across libm builds or CPU
variants (glibc picks an FMA build of its exp at run time), and a GPU's exp is another function
again. A draw that is to give the same token on the host, on another host and inside a decode
step's kernel needs an exp whose every step is a correctly rounded float64 operation: then any
IEEE machine computes the same bits, given the same operations in the same order and no fused
multiply-adds.

The method (Cody and Waite's, as fdlibm reduces): n = floor(x / ln 2 + 1/2), r = (x - n ln2_hi) -
n ln2_lo with ln 2 split so that n ln2_hi is exact, |r| <= ~0.347; e^r by its Taylor series to
degree 13 in Horner form (the first term left out is r^14 / 14! < 5e-18 of the result); the
result p * 2^n is exact scaling. Against correctly rounded e^x it is within 1 ulp (tested
against a 50-digit oracle); against this machine's `math.exp` it differed in ~10% of arguments,
always by 1 ulp.

Domain: x <= 0 (a weight relative to the largest). Below FLUSH_BELOW the result is 0.0 instead
of a number under ~1e-307 (the scaling then stays in normal numbers, where it is exact, on every
machine); -inf gives 0.0 and NaN gives NaN; x > 0 raises ValueError.

May import: math only.
"""

from __future__ import annotations

import math

# ln 2 in two parts (fdlibm's ln2_hi / ln2_lo): ln2_hi has 32 significant bits, so n * ln2_hi is
# exact for every |n| < 2^21
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
# 1/k! for k = 13 down to 0, each the correctly rounded float64 (Horner order)
TAYLOR = tuple(1.0 / math.factorial(k) for k in range(13, -1, -1))
# below this, 0.0: n stays >= -1021, so p * 2^n (p in [0.70, 1.42]) is a normal number
FLUSH_BELOW = -707.0


def portable_exp(x: float) -> float:
    """e^x for x <= 0 (see the module docstring), the same bits on every IEEE-754 machine."""
    if x != x:
        return x
    if x > 0.0:
        raise ValueError(f"portable_exp takes x <= 0, got {x!r}")
    if x < FLUSH_BELOW:
        return 0.0
    n = math.floor(x * INV_LN2 + 0.5)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = TAYLOR[0]
    for c in TAYLOR[1:]:
        p = p * r + c
    return math.ldexp(p, n)
