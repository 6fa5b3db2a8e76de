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
                reuse_the_launchs_language_patch(REUSE_LANGUAGE_PATCH)
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


# ------------------------------------------------------------------ the interpreter's patching
# Whether interpreted launches reuse their patch of `triton.language` in their helpers (below);
# False: triton's own patching, at every helper call (the oracle of the reuse's test).
REUSE_LANGUAGE_PATCH = True
_REUSE: dict[str, Any] = {}  # the interpreter's own functions, while the reuse is in force


def reuse_the_launchs_language_patch(enabled: bool = True) -> bool:
    """Under Triton's interpreter, a launch patches `triton.language` (its builtins swapped for
    numpy-backed ones) once, and every call of a jitted helper inside it (`_round_int8`,
    `tl.zeros`, ...) patches it again: a `inspect.getmembers` scan of the language modules and a
    few hundred `setattr`s, per helper call, per program. Our kernels call helpers in their inner
    blocks, so that re-patching was about half of an interpreted kernel's time (the norm-quant
    kernel ~2x faster without it, whole CPU tests 1.3-1.6x: RESULTS, session 36). Inside a
    launch the helper's language modules are the kernel's own, already patched, so the re-patch
    changes nothing: this makes a helper's call skip it when every language module the helper
    sees is patched for the launch, and patch as before otherwise (a helper that sees `tl.core`
    where the kernel saw only `tl`).
    The values every op computes are the same (tests/engine/kernels/test_interpreter_patch.py);
    only CPU runs of the kernels, the tests', interpret. Every interpreted launch calls this
    with `REUSE_LANGUAGE_PATCH`; `enabled=False` puts triton's own functions back. Returns
    whether the reuse is in force: it is left out, and triton kept as it is, where triton's
    interpreter lacks the two functions it wraps."""
    from triton.runtime import interpreter

    if not enabled:
        if _REUSE:
            interpreter._patch_lang = _REUSE.pop("patch_lang")
            interpreter.GridExecutor.__call__ = _REUSE.pop("launch")
        return False
    if _REUSE:
        return True
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    launch = executor.__dict__.get("__call__") if isinstance(executor, type) else None
    if patch_lang is None or launch is None:
        return False
    import triton.language as tl

    patched: list[set[int]] = []  # per launch in progress: the language modules patched for it
    seen: dict[Any, frozenset[int]] = {}

    def languages(fn: Any) -> frozenset[int]:
        """The language modules `_patch_lang` patches for fn: those its globals name."""
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return seen[fn]

    def patch_lang_once(fn: Any) -> Any:
        need = languages(fn)
        if patched and patched[-1] and need <= patched[-1]:
            return _NothingToRestore()  # a helper inside the launch: its languages are patched
        scope = patch_lang(fn)
        if patched:
            patched[-1] |= need
        return scope

    def launch_patching_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.append(set())  # the launch's own `_patch_lang` comes first and patches in full
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    _REUSE.update(patch_lang=patch_lang, launch=launch)
    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_patching_once
    return True


class _NothingToRestore:
    """The scope of a patch that was skipped: restoring it is restoring nothing."""

    def restore(self) -> None:
        return None


def triton_loaded() -> bool:
    return "triton" in sys.modules


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
