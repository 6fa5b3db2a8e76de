"""One-pass forest tests run the real Triton kernels: compiled on CUDA, interpreted on CPU.

As in tests/engine/kernels: triton picks its interpreter when first imported, so the variable
is set here, at collection, before anything imports triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")  # only now: importing triton fixes the interpreter choice
