"""Compile every Triton kernel the int8 GPU path launches, for Hopper, on a machine without a GPU.

For each model shape: every distinct launch (`engine.kernels.aot.engine_launches`) compiled for
sm_90 with its real constexprs; prints shared memory, registers per thread and local memory
(stack + spills) per kernel. A kernel that does not compile, or whose shared memory exceeds what
an H200 block may use, fails the run.

    python ops/bench/kernel_resources.py --shape 27B
    python ops/bench/kernel_resources.py --shape tiny --shape 27B --jobs 2

`--jobs N` compiles in N worker processes (each compile is one single-threaded Triton/ptxas run,
so a CI machine's other cores would otherwise idle for the minute and a half it takes); every
worker records the same launches itself (recording is cheap, and the 27B weights it allocates
are never touched), so only a launch's index crosses the process boundary. The table is the same
whatever N is, in the same order.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from functools import partial

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: the interpreter would be chosen otherwise

from bench_engine import SHAPES, shape_config  # noqa: E402

from engine.kernels.aot import Launch, compile_launch, engine_launches  # noqa: E402

H200_SHARED_BYTES = 232_448  # per block, opt-in maximum on compute capability 9.0
_LAUNCHES: dict[str, list[Launch]] = {}  # per shape, recorded once per process


def _launches(shape: str) -> list[Launch]:
    if shape not in _LAUNCHES:
        _LAUNCHES[shape] = engine_launches(shape_config(shape))
    return _LAUNCHES[shape]


def _compile(shape: str, index: int) -> tuple[str, int, int | None, int | None, float]:
    """Compile launch `index` of `shape`: (name, shared bytes, registers, local bytes, seconds).
    Runs in the main process or a worker; what it returns is small enough to cross back."""
    t0 = time.perf_counter()
    got = compile_launch(_launches(shape)[index])
    return got.name, got.shared_bytes, got.registers, got.local_bytes, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default 27B")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many worker processes")
    args = ap.parse_args()
    shapes = args.shape or ["27B"]
    failed = 0
    # spawn, not fork: this process holds torch's thread pools, which a forked child must not use
    pool = (
        ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
        if args.jobs > 1
        else None
    )
    with pool or nullcontext():
        # one result getter per launch; a pool has every compile queued before the first is reported
        queued: dict[str, list[Callable[[], tuple]]] = {
            shape: [
                pool.submit(_compile, shape, i).result if pool else partial(_compile, shape, i)
                for i in range(len(_launches(shape)))
            ]
            for shape in shapes
        }
        for shape in shapes:
            launches = _launches(shape)
            print(f"{shape}: {len(launches)} distinct launches", flush=True)
            print(
                f"  {'kernel':<28} {'shared KiB':>10} {'regs':>5} {'local B':>8} {'compile s':>9}  constexprs"
            )
            for launch, result in zip(launches, queued[shape], strict=True):
                consts = {k: v for k, v in launch.meta.items() if k.isupper()}
                try:
                    name, shared, registers, local, seconds = result()
                except Exception as e:  # report every kernel, then fail
                    failed += 1
                    print(f"  {launch.name:<28} FAILED: {type(e).__name__}: {str(e)[:300]}  {consts}")
                    continue
                over = shared > H200_SHARED_BYTES
                failed += over
                row = f"{shared / 1024:>10.1f} {registers!s:>5} {local!s:>8} {seconds:>9.1f}"
                print(
                    f"  {name:<28} {row}  {consts}"
                    + ("  <- over the H200 shared memory limit" if over else ""),
                    flush=True,
                )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
