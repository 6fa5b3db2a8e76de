"""The one-pass body under tensor parallelism: 2 gloo ranks (Triton interpreter) give the bits of one.

Oracle: the single-process engine with the body (every probability and logit as float.hex),
first with the evidence computed, then with it from the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from engine.engine import Engine
from tests.engine.test_int8_invariance import _bits, _requests

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case; on 2 GPUs run test_tp.py"),
]


def test_two_ranks_run_the_forest_body_with_the_bits_of_one_process(gguf_model: Callable[..., Path]) -> None:
    path = gguf_model("Q8_0", "tiny", 0, False, 4)
    # no thinkers: a thought is many more interpreted passes, and test_tp covers them on GPUs
    requests = [r for r in _requests() if r.gate != 1.0][:3]
    one = Engine.load(path, precision="int8", cache_bytes=1 << 28, body=True)
    expected = [_bits(r) for r in one.decide(requests)]
    two = Engine.load(path, precision="int8", cache_bytes=1 << 28, tp=2, body=True)
    try:
        assert two.body is not None and not two.body.graphs
        first = [_bits(r) for r in two.decide(requests)]
        again = [_bits(r) for r in two.decide(requests[::-1])][::-1]  # evidence from the cache
        assert two.cache.stats.hits >= len(requests)
    finally:
        two.close()
    assert not dist.is_initialized()
    assert first == expected
    assert again == expected
