"""Build CUTLASS's own Hopper FMHA example (88_hopper_fmha, from the nvidia-cutlass wheel that
`make cutlass` unpacks) as a forward-only head-256 probe, to time a FlashAttention-3-class kernel
beside our long attention tier on one card.

    python ops/bench/probe_fmha.py                 # dev machine: builds .cache/probe/fmha256
    .cache/probe/fmha256 --b=1 --h=24 --q=8192 --k=8192 --d=256 --mask=causal --iterations=200
                                                   # GPU machine (carry .cache/probe)
    python3 ops/bench/bench_attention.py --workload c --heads 27B --quick --no-kernels   # ours

Why a probe and not a kernel: session 28 (RESULTS.md) asked whether our Triton long tier's ~300
TFLOP/s at head 256 (27B's (c): ~2.5-2.8 ms a layer at 8k on an H100) is what Hopper gives at that
head size. The example answers it with a warp-specialized TMA kernel on the same card. Nothing of
the example enters the engine: this script copies it into `.cache/probe/` and edits it there.

The edits (each anchor checked, so a CUTLASS version whose text moved fails loudly):
- its random fill comes from cuRAND's headers, which the nvcc wheels lack: a hash fill instead
  (the probe times; `--verify` still compares with the example's own reference);
- `main` runs the head-256 forward kernels only (causal or not), not every head size, backward
  and mask combination (one build of ~1.5 minutes on two cores instead of many);
- beside the example's 128x64 tile, a 128x32 one and a 128x128 one (the latter fails to
  initialize at head 256 in 16-bit types: too much shared memory; kept to show it).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.kernels import cutlass_gemm  # noqa: E402

PROBE = cutlass_gemm.REPO / ".cache" / "probe"
EXAMPLE = "88_hopper_fmha"

_FILL_INCLUDE = '#include "cutlass/util/reference/device/tensor_fill.h"\n'
_INIT_START = "template <class Element>\nbool initialize_block("
_INIT_END = "struct ExampleResult {"
_HASH_FILL = """template <class Element>
__global__ void probe_fill(Element* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    p[i] = Element(float((x >> 40) & 0xFFFF) / 32768.0f - 1.0f);  // uniform in [-1, 1)
  }
}

template <class Element>
bool initialize_block(cutlass::DeviceAllocation<Element>& block, uint64_t seed = 2023, bool = false) {
  probe_fill<<<1024, 256>>>(block.get(), block.size(), seed);
  return true;
}

"""
_DISPATCH_START = "  with_fusion([&](auto fusion) {"
_DISPATCH_END = "#endif\n\n  return 0;"
_DISPATCH = """  if (options.causal) {
    run_fwd_256(CausalFusion{}, options, hw_info);
  } else {
    run_fwd_256(DefaultFusion{}, options, hw_info);
  }
"""
_TILE = '  run(Shape<_128, _64, HeadDim>{}, KernelCooperative{}, "tma ws cooperative 128x64x256");\n'
_TILES = (
    _TILE
    + '  run(Shape<_128, _32, HeadDim>{}, KernelCooperative{}, "tma ws cooperative 128x32x256");\n'
    + '  run(Shape<_128, _128, HeadDim>{}, KernelCooperative{}, "tma ws cooperative 128x128x256");\n'
)


def _replace_between(text: str, start: str, end: str, new: str) -> str:
    """text with [start, end) replaced by new; both anchors must be present."""
    a = text.find(start)
    b = text.find(end, a)
    if a < 0 or b < 0:
        raise SystemExit(f"probe_fmha: anchor not found ({start!r} .. {end!r}): another CUTLASS version?")
    return text[:a] + new + text[b:]


def patched_source(text: str) -> str:
    """The example's main file with the probe's three edits (module docstring)."""
    for anchor in (_FILL_INCLUDE, _TILE):
        if anchor not in text:
            raise SystemExit(f"probe_fmha: anchor not found ({anchor!r}): another CUTLASS version?")
    text = text.replace(_FILL_INCLUDE, "")
    text = _replace_between(text, _INIT_START, _INIT_END, _HASH_FILL)
    text = _replace_between(text, _DISPATCH_START, _DISPATCH_END, _DISPATCH)
    return text.replace(_TILE, _TILES, 1)


def build(out: Path) -> Path:
    include, util = cutlass_gemm._cutlass_include()
    source_root = include.parent
    example = source_root / "examples" / EXAMPLE
    if not example.is_dir():
        raise SystemExit(f"probe_fmha: no {example}: run `make cutlass` first")
    work = PROBE / "src"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(example, work)
    main = work / f"{EXAMPLE}.cu"
    main.write_text(patched_source(main.read_text()))
    nvcc = cutlass_gemm._nvcc()
    cuda_root = Path(nvcc).resolve().parent.parent
    cmd = [
        nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
        "-gencode=arch=compute_90a,code=sm_90a", f"-I{work}", f"-I{include}", f"-I{util}",
        f"-I{source_root / 'examples' / 'common'}", "-cudart", "static",
        f"-L{cuda_root / 'lib'}", f"-L{cuda_root / 'lib64'}", str(main), "-o", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"probe_fmha: nvcc failed:\n{run.stderr[-4000:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=PROBE / "fmha256", help="the probe binary")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(f"{build(args.out)}\n")


if __name__ == "__main__":
    main()
