"""Compile every Triton kernel the int8 GPU path launches, for Hopper, on a machine without a GPU.

For each model shape: every distinct launch (`engine.kernels.aot.engine_launches`) compiled for
sm_90 with its real constexprs; prints shared memory, registers per thread and local memory
(stack + spills) per kernel. A kernel that does not compile, or whose shared memory exceeds what
an H200 block may use, fails the run.

    python ops/bench/kernel_resources.py --shape 27B
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile for real: the interpreter would be chosen otherwise

from bench_engine import SHAPES, shape_config  # noqa: E402

from engine.kernels.aot import compile_launch, engine_launches  # noqa: E402

H200_SHARED_BYTES = 232_448  # per block, opt-in maximum on compute capability 9.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable; default 27B")
    args = ap.parse_args()
    failed = 0
    for shape in args.shape or ["27B"]:
        launches = engine_launches(shape_config(shape))
        print(f"{shape}: {len(launches)} distinct launches", flush=True)
        print(f"  {'kernel':<28} {'shared KiB':>10} {'regs':>5} {'local B':>8} {'compile s':>9}  constexprs")
        for launch in launches:
            t0 = time.perf_counter()
            consts = {k: v for k, v in launch.meta.items() if k.isupper()}
            try:
                got = compile_launch(launch)
            except Exception as e:  # report every kernel, then fail
                failed += 1
                print(f"  {launch.name:<28} FAILED: {type(e).__name__}: {str(e)[:300]}  {consts}")
                continue
            over = got.shared_bytes > H200_SHARED_BYTES
            failed += over
            print(
                f"  {got.name:<28} {got.shared_bytes / 1024:>10.1f} {got.registers!s:>5} "
                f"{got.local_bytes!s:>8} {time.perf_counter() - t0:>9.1f}  {consts}"
                + ("  <- over the H200 shared memory limit" if over else ""),
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
