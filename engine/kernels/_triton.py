"""Triton plumbing shared by the kernels: backend choice, lazy import and jit, the interpreter.

Nothing here imports triton until a kernel is first launched. Triton's interpreter (used by
the CPU tests) is chosen by `TRITON_INTERPRET=1` at the moment triton is *imported* - its own
library functions are jitted then - so deferring the import lets a test conftest set that
variable even after `engine` was imported. Kernel modules declare `tl`/`libdevice` as
placeholders; the first launch binds them to the real modules and jits the body.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Any, Literal

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None

Backend = Literal["auto", "triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")
# Launch options only the compiler understands; the interpreter rejects them.
_COMPILE_ONLY = ("num_warps", "num_stages", "enable_fp_fusion")


def use_triton(backend: str, like: torch.Tensor) -> bool:
    """Whether a call with `backend` on tensors like `like` runs the Triton kernel.

    "auto": the kernel on CUDA, the torch reference elsewhere; "triton": always the kernel (on
    CPU through Triton's interpreter, for tests); "torch": always the reference.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return HAVE_TRITON and like.is_cuda
    if not HAVE_TRITON:
        raise RuntimeError("backend='triton' needs the triton package, which is not installed")
    return True


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (decided when triton was imported)."""
    import triton.language as tl

    return type(tl.standard.cdiv).__name__ == "InterpretedFunction"


# Set by `engine.kernels.aot.record`: launches are handed to it instead of running.
RECORDER: Callable[[LazyKernel, tuple[int, ...], tuple[Any, ...], dict[str, Any]], None] | None = None


class LazyKernel:
    """A kernel body jitted on first launch; `kernel[grid](*args, **meta)` launches it.

    The constexpr `ON_GPU` is filled in, so a body can use libdevice when compiled and plain
    (numpy-backed) ops under the interpreter, which has no libdevice.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._jitted: Any = None

    def _get(self) -> Any:
        if self._jitted is None:
            import triton

            bind(self.fn)
            self._jitted = triton.jit(self.fn)
        return self._jitted

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def launch(*args: Any, **meta: Any) -> Any:
            if RECORDER is not None:  # engine.kernels.aot: note the launch, run nothing
                RECORDER(self, grid, args, meta)
                return None
            jitted = self._get()
            on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
            interp = interpreting()
            if not on_gpu and not interp:
                raise RuntimeError(
                    "a Triton kernel got CPU tensors but triton was imported in compiled mode: set "
                    "TRITON_INTERPRET=1 before triton is first imported to run kernels on CPU"
                )
            meta["ON_GPU"] = not interp
            if interp:
                meta = {k: v for k, v in meta.items() if k not in _COMPILE_ONLY}
            return jitted[grid](*args, **meta)

        return launch


def kernel(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)


class LazyHelper:
    """A function kernels call (inlined by Triton), jitted when the first kernel naming it is."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._jitted: Any = None

    def jitted(self) -> Any:
        if self._jitted is None:
            import triton

            self._jitted = triton.jit(self.fn)  # first: binding its own module finds it done
            bind(self.fn)
        return self._jitted


def helper(fn: Callable[..., Any]) -> LazyHelper:
    return LazyHelper(fn)


def bind(fn: Callable[..., Any]) -> None:
    """Bind `tl`/`libdevice` in fn's module and swap the helpers it names for their jitted form."""
    import triton.language as tl
    from triton.language.extra import libdevice

    module_globals = fn.__globals__
    module_globals["tl"] = tl
    module_globals["libdevice"] = libdevice
    for name, value in list(module_globals.items()):
        if isinstance(value, LazyHelper):
            module_globals[name] = value.jitted()


def triton_loaded() -> bool:
    return "triton" in sys.modules


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
