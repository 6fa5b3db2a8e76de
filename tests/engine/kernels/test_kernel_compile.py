"""Every Triton kernel the int8 GPU path launches compiles for Hopper (sm_90), here, without a GPU.

The interpreter the other kernel tests use accepts programs the compiler rejects (unsupported
constructs, dot shapes, types) and knows nothing of shared memory. `ops/bench/kernel_resources.py`
compiles each distinct launch the engine makes, with its real constexprs, at the 27B (the largest
shape we serve; the tiny test shape's launches compile in the GPU suite, and here they took ~40%
of the test's minutes on CI's two cores): the compiler is the oracle, plus the per-block shared-memory
limit of an H200. It runs in a fresh process (this one imported triton in interpreter mode) with an
empty kernel cache, compiling in one worker per core (up to 4): each compile is single-threaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")
pytestmark = pytest.mark.slow  # ~20 compilations per shape

REPO = Path(__file__).resolve().parents[3]


def test_every_engine_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # really compile, never reuse
    # the repo first, then whatever the caller put there (a GPU image carries packages on PYTHONPATH)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    run = subprocess.run(
        [
            *(sys.executable, "ops/bench/kernel_resources.py", "--shape", "27B"),
            *("--jobs", str(max(1, min(4, len(os.sched_getaffinity(0)))))),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "FAILED" not in out and "over the H200" not in out, out[-4000:]
    for kernel in ("_forest_conv_kernel", "_forest_gdn_kernel", "_prep_kernel", "_attention_kernel"):
        assert kernel in out, (kernel, out[-4000:])
