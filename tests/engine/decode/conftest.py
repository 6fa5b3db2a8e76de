"""Decoder tests run the real Triton kernels: compiled on CUDA, interpreted on CPU.

As in tests/engine/kernels: triton picks its interpreter when first imported, so the variable
is set here, at collection, before anything imports triton.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from decode_engines import same_weights

if TYPE_CHECKING:
    from engine.engine import Engine

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")  # only now: importing triton fixes the interpreter choice


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


@pytest.fixture(scope="module")
def engine(gguf_model: Callable[..., Path]) -> Engine:
    """The int8 tiny engine the decoder tests share (imported here, after the interpreter choice).

    The tests hold the decoder to the forest thought loop within fp32 rounding, so the forest
    runs the exact body: the CUDA default's tensor-core settings round in bf16 (their accuracy
    is measured by ops/bench/bench_engine.py --accuracy, RESULTS.md)."""
    from engine.engine import Engine

    model = gguf_model("Q8_0", "tiny", seed=11)
    return Engine.load(model, device=DEVICE, precision="int8", cache_bytes=0, body_settings={})


@pytest.fixture(scope="module")
def decoder_engine(engine: Engine) -> Engine:
    """The decode tests' engine with its thoughts on the decoder (forced on CPU)."""
    return same_weights(engine, decoder=True)


@pytest.fixture(scope="module")
def forest_engine(engine: Engine) -> Engine:
    """The same engine with its thoughts as forest steps (the decoder's oracle)."""
    return same_weights(engine, decoder=False)
