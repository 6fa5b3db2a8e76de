"""Kernel tests run the real Triton kernel bodies: compiled on CUDA, interpreted on CPU.

Triton picks its interpreter when it is first imported, so the variable is set here, at
collection time, before any test imports triton (engine.kernels imports it lazily).
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")  # only now: importing triton fixes the interpreter choice


@pytest.fixture
def dev() -> torch.device:
    return torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
