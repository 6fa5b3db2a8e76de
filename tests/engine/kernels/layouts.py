"""The sm_90 layouts of compiled Triton reductions, for tests that hold two kernels' sums to the
same order without a GPU: the lowering of `tl.sum` (each thread's own adds, the shuffles, the
cross-warp step) follows from the reduced tensor's shape and layout alone, so two kernels whose
lanes hold the same values in the same layout sum them to the same bits on the GPU too. The
interpreter's tests cannot see that order; these compile for Hopper on the CPU.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def compile_script(script: str, args: list[str], cache_dir: Path) -> str:
    """Run `script` (which records launches and compiles them, `engine.kernels.aot`) in a fresh
    interpreter with triton in compiled mode and its cache at cache_dir; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    run = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def sum_layouts(cache_dir: Path) -> list[tuple[str, str, str]]:
    """(kernel name, shape, layout) of every single-operand `tt.reduce` that adds, in the TTGIR of
    every kernel compiled into cache_dir; the layout spelled out (`#ttg.blocked<{...}>`)."""
    found = []
    for path in glob.glob(os.path.join(cache_dir, "*", "*.ttgir")):
        text = Path(path).read_text()
        aliases = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{.*\}>)", text, re.M))
        for body in text.split('"tt.reduce"(')[1:]:
            region, _, rest = body.partition("}) : (")
            operands = rest.split(")", 1)[0].split("tensor<")[1:]  # e.g. 4096xf32, #blocked>
            if len(operands) != 1 or "arith.addf" not in region:
                continue
            shape, layout = operands[0].rstrip(", ").removesuffix(">").split(", ")
            found.append((Path(path).stem, shape, aliases.get(layout, layout)))
    return sorted(set(found))
