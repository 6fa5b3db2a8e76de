"""The decoder under tensor parallelism: 2 gloo ranks (Triton interpreter) decode the bits of one.

Oracle: the single-process decoder (thought tokens, both read-outs, every float as float.hex).
The CUDA case (NCCL, 2 GPUs) is tests/engine/test_tp.py's, where thoughts take the decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from tests.engine.test_int8_invariance import _bits, _requests

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case; CUDA runs test_tp.py")


def test_two_ranks_decode_the_thoughts_of_one_process(gguf_model: Callable[..., Path]) -> None:
    path = gguf_model("Q8_0", "tiny", 0, False, 4)
    requests = [r for r in _requests() if r.gate == 1.0][:3]  # thinkers, 3-token budgets
    one = Engine.load(path, precision="int8", cache_bytes=0, decoder=True)
    results = one.decide(requests)
    assert one.runner.decoder.steps > 0 and all(
        t.second is not None for r in results for t in r.traces.values()
    )
    two = Engine.load(path, precision="int8", cache_bytes=0, tp=2, decoder=True)  # every rank loads it
    try:
        got = [_bits(r) for r in two.decide(requests)]
        assert two.runner.decoder.steps > 0
    finally:
        two.close()
    assert got == [_bits(r) for r in results]
