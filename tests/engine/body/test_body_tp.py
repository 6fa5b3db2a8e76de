"""The one-pass body under tensor parallelism: 2 gloo ranks (Triton interpreter) give the bits of one.

Oracle: the single-process body's batch of the session (conftest's `body_decisions`, which
test_body_engine shows bit-equal to each request alone and from the cache), every probability
and logit as float.hex; the two ranks decide first with the evidence computed, then with it
from the prefix cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from body_cases import CACHE_BYTES, REQUESTS, THINKER, BodyDecisions

from engine.engine import Engine
from tests.engine.test_int8_invariance import _bits

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case; on 2 GPUs run test_tp.py"),
]


def test_two_ranks_run_the_forest_body_with_the_bits_of_one_process(
    body_model: Path, body_decisions: BodyDecisions
) -> None:
    # no thinkers: a thought is many more interpreted passes, and test_tp covers them on GPUs
    keep = [i for i in range(len(REQUESTS)) if i != THINKER]
    requests = [REQUESTS[i] for i in keep]
    expected = [_bits(body_decisions.batch[i]) for i in keep]
    two = Engine.load(body_model, precision="int8", cache_bytes=CACHE_BYTES, tp=2, body=True)
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
