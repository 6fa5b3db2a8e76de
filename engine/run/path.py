"""The execution path, chosen once when an engine loads: precision -> dtype -> runner.

Everything downstream reads this one value instead of re-deriving it from the device, the
precision or the weights: which forest runner (`engine.run.body` or the level executor), the
float dtype, the body's tensor-core settings, whether thoughts step on `engine.run.decoder`
and with which attention dots, and whether CUDA graphs may be captured.

May import: torch only (it names modules, it does not import them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

Precision = Literal["fp32", "bf16", "int8"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "int8")

# The one-pass body (engine.run.body) is the CUDA int8 path: it passed the int8 invariance suite on
# an H200 (2026-12-01, f2bc914) and is 4.6-6.8x faster than the level executor on (a), (b), (d) at 27B.
# The level-by-level executor stays as the CPU/fp32/bf16 oracle (`body=False` still picks it on
# CUDA for tests that compare against it; it makes no batch-invariance promise there).
BODY_BY_DEFAULT = True
# The body's tensor-core settings on CUDA: chunk-64 GDN with bf16 operands (fp32 accumulation and
# state) and bf16 attention dots. Every setting is batch invariant (fixed configs, chunks and
# blocks aligned to segment starts); they differ from the exact fp32-dot body in rounding only.
# Measured 2026-12-01 on an H200 (ops/bench/RESULTS.md, "tensor-core body"): 27B (c) 639 ms vs
# 3,260 ms for the exact body, and at the 4B shape against the fp32 reference path they agree on
# 33 of 35 decisive read-outs (the exact int8 body: 34 of 35) with a smaller largest |delta p|
# (0.143 vs 0.189): the int8 quantization, not these dots, sets the distance to fp32. On CPU (the
# interpreter, tests) the body keeps its exact defaults. gdn_prep "auto" (2026-12-02, session 8):
# the chunk's state-free products by whole-chunk products and a blocked inverse where the head
# sizes are multiples of 64 (every released model): 27B (c) 561.7 -> 545.5 ms, (b) 37.1 -> 36.2,
# 4B (a) 10.1 -> 9.2 ms in one process on one weight build, and at the 4B shape against fp32
# 35 of 35 decisive read-outs agree (the blocks form: 33 of 35), largest |delta p| 0.166.
CUDA_BODY_SETTINGS: Mapping[str, int | str] = {
    "gdn_chunk": 64,
    "gdn_dots": "bf16",
    "attention_dots": "bf16",
    "gdn_prep": "auto",
}
EXACT_DOTS = "ieee"  # the exact body's (and a body-less decoder's) attention dots


def default_precision(device: str | torch.device) -> Precision:
    """int8 on CUDA (the batch-invariant serving path), fp32 elsewhere (the CPU oracle)."""
    return "int8" if torch.device(device).type == "cuda" else "fp32"


@dataclass(frozen=True)
class ExecutionPath:
    """How this engine computes, fixed at load (`choose_path`)."""

    precision: Precision
    device: torch.device
    dtype: torch.dtype  # the float weights' and activations' dtype: bf16 for bf16, fp32 otherwise
    body: bool  # forests in one pass (engine.run.body); False: the level executor
    decoder: bool  # thoughts step on engine.run.decoder; False: one forest per step
    body_settings: Mapping[str, int | str] = field(default_factory=dict)  # ForestBody's keywords
    decoder_dots: str = EXACT_DOTS  # the decoder's attention dots
    graphs: bool | None = None  # None: capture CUDA graphs where they run; False: eager (tensor parallel)


def dtype_for(precision: Precision) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def choose_path(
    device: str | torch.device,
    precision: Precision | None = None,
    *,
    body: bool | None = None,
    decoder: bool | None = None,
    body_settings: Mapping[str, int | str] | None = None,
    decoder_dots: str | None = None,
    tensor_parallel: bool = False,
) -> ExecutionPath:
    """The path for `device`: every argument left None takes its default.

    precision: int8 on CUDA, fp32 elsewhere. body: `BODY_BY_DEFAULT` on CUDA int8 - the serving
    path - and the level executor elsewhere (the CPU/fp32/bf16 oracle, which the interpreter-run
    body would only slow down); the body is int8-only: the float paths are references, and a
    float body would be a second implementation of them. decoder: int8 on CUDA (with or without
    tensor parallelism: the decoder gathers whole rows where one device would quantize them);
    tests force it on CPU. body_settings: `CUDA_BODY_SETTINGS` on CUDA, the exact body elsewhere.
    decoder_dots: the body's attention dots, exact without a body. Under tensor parallelism
    passes hold collectives: eager (same kernels, same bits) rather than NCCL calls in a graph.
    """
    dev = torch.device(device)
    precision = default_precision(dev) if precision is None else precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be fp32, bf16 or int8, got {precision!r}")
    if tensor_parallel and precision != "int8":
        raise ValueError(f"tensor parallelism runs the int8 path only, not {precision}")
    if body is None:
        body = BODY_BY_DEFAULT and precision == "int8" and dev.type == "cuda"
    if body and precision != "int8":
        raise ValueError(f"the one-pass forest body runs the int8 path only, not {precision}")
    if decoder is None:
        decoder = precision == "int8" and dev.type == "cuda"
    if body_settings is None:
        body_settings = CUDA_BODY_SETTINGS if dev.type == "cuda" else {}
    if decoder_dots is None:
        decoder_dots = str(body_settings.get("attention_dots", EXACT_DOTS)) if body else EXACT_DOTS
    return ExecutionPath(
        precision=precision,
        device=dev,
        dtype=dtype_for(precision),
        body=body,
        decoder=decoder,
        body_settings=dict(body_settings) if body else {},
        decoder_dots=decoder_dots,
        graphs=False if tensor_parallel else None,
    )
