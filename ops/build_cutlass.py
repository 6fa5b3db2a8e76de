"""Build the optional CUTLASS int8 GEMM library (`engine/kernels/cutlass_gemm.py`) for Hopper.

    python ops/build_cutlass.py --toolchain [--out PATH] [--jobs N]    # make cutlass
    python ops/build_cutlass.py --candidates [--configs A,B]           # bench_cutlass.py's library

Needs nvcc (CUDA_HOME, PATH, or NVIDIA's wheels) and CUTLASS's headers (CUTLASS_HOME or the
nvidia-cutlass wheel); no GPU. `--toolchain` first unpacks those wheels into
`.cache/cutlass-toolchain/` (pip --target, no dependencies: the venv and its torch stay as they
are). Prints the library's path. To use it on another machine, copy
`.cache/cutlass/` there (the engine looks under the digest of its own sources) or point
PRISM_CUTLASS_LIB at the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.kernels import cutlass_gemm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="library path (default: under .cache/cutlass)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel nvcc processes (default: CPU count)")
    ap.add_argument(
        "--candidates", action="store_true", help="every candidate config (ops/bench/bench_cutlass.py)"
    )
    ap.add_argument("--configs", default=None, help="with --candidates: only these (comma list of names)")
    ap.add_argument(
        "--toolchain",
        action="store_true",
        help="first unpack nvcc's and CUTLASS's wheels (.cache/cutlass-toolchain)",
    )
    args = ap.parse_args()
    if args.toolchain:
        cutlass_gemm.install_toolchain()
    configs = cutlass_gemm.candidates(args.configs) if args.candidates else cutlass_gemm.CONFIGS
    sys.stdout.write(f"{cutlass_gemm.build(args.out, args.jobs, configs)}\n")


if __name__ == "__main__":
    main()
