"""Compile the Triton kernels for a GPU this machine does not have (ahead of time, no driver).

CI has no GPU, and Triton's interpreter accepts programs the compiler rejects (or compiles
into something that does not fit: shared memory, registers). `record()` runs the public kernel
wrappers on small CPU tensors without executing anything: every launch they would make is
recorded with its real constexprs and argument types; `compile_launch` then compiles each one
for a target such as Hopper (sm_90), through the `ptxas` shipped in the triton wheel.

    with record() as launches:
        forest_attention(q, qg, base, rows, segs, pieces, qblocks, num_kv_heads=4)
    for launch in launches:
        print(launch.name, compile_launch(launch).shared_bytes)
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels import _triton
from engine.model.config import ModelConfig

HOPPER = ("cuda", 90, 32)  # H100 / H200: compute capability 9.0, warp size 32
_DTYPES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
}


@dataclass
class Launch:
    """One recorded kernel launch: the kernel, its grid, arguments and launch options."""

    kernel: _triton.LazyKernel
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: dict[str, Any]

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclass
class Compiled:
    """What the compiler made of a launch: the cubin's resources per thread block."""

    name: str
    shared_bytes: int
    registers: int | None  # per thread, from cuobjdump (None when it is not available)
    local_bytes: int | None  # stack frame + spilled registers
    cubin: bytes


@contextlib.contextmanager
def record() -> Iterator[list[Launch]]:
    """Within the block, kernel launches are recorded into the yielded list, not executed."""
    launches: list[Launch] = []
    previous = _triton.RECORDER
    _triton.RECORDER = lambda kernel, grid, args, meta: launches.append(Launch(kernel, grid, args, meta))
    try:
        yield launches
    finally:
        _triton.RECORDER = previous


def _arg_type(value: Any) -> str:
    if type(value).__name__ == "TensorDescriptor":  # triton.tools.tensor_descriptor (TMA)
        return f"tensordesc<{_DTYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPES:
            raise ValueError(f"no Triton pointer type for {value.dtype}")
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise ValueError(f"no Triton argument type for {type(value).__name__}")


def compile_launch(launch: Launch, target: tuple[str, int, int] = HOPPER) -> Compiled:
    """Compile the launch's kernel for `target` as Triton's JIT would at that launch: the same
    constexprs, argument types and specializations (16-byte aligned pointers, integers divisible
    by 16 or equal to 1), which decide vectorized and asynchronous loads."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = launch.kernel.fn
    _triton.bind(fn)
    jitted = JITFunction(fn)
    backend = make_backend(GPUTarget(*target))
    meta = {**launch.meta, "ON_GPU": True}
    binder = create_function_from_signature(jitted.signature, jitted.params, backend)
    bound, specialization, options = binder(*launch.args, **meta)
    options, signature, constexprs, attrs = jitted._pack_args(backend, meta, bound, specialization, options)
    source = ASTSource(jitted, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget(*target), options=options.__dict__)
    cubin = compiled.asm["cubin"]
    registers, spills = _resource_usage(cubin)
    return Compiled(fn.__name__, int(compiled.metadata.shared), registers, spills, cubin)


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """Registers per thread and local-memory bytes (stack + spills) of the cubin, via cuobjdump."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run(
                [tool, "-res-usage", f.name], capture_output=True, text=True, check=True, timeout=60
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    registers = re.search(r"REG:(\d+)", text)
    local = [int(m) for m in re.findall(r"(?:STACK|LOCAL):(\d+)", text)]
    return (int(registers.group(1)) if registers else None), (sum(local) if local else None)


def _dedupe(launches: list[Launch]) -> list[Launch]:
    """One launch per distinct compile: kernel, constexprs, options and argument types."""
    seen: dict[tuple, Launch] = {}
    for launch in launches:
        key = (
            launch.name,
            tuple(sorted((k, repr(v)) for k, v in launch.meta.items())),
            tuple(_arg_type(a) for a in launch.args),
        )
        seen.setdefault(key, launch)
    return list(seen.values())


def engine_launches(config: ModelConfig, rows: int = 16) -> list[Launch]:
    """Every distinct kernel launch the int8 GPU path makes for a model of `config`'s sizes:
    the GEMM tiles (small and large M), norms and quantizers at each row length, the level
    executor's varlen kernels, the decoder's step kernels and the forest body's kernels.

    Runs the public wrappers on small CPU tensors inside `record()`; nothing executes, and the
    weights are allocated but never touched, so a 27B shape costs no memory.
    """
    from engine.kernels import (
        GemmConfig,
        decode_quant,
        int8_gemm,
        quantize_rows,
        rms_norm_quantize,
    )
    from engine.kernels import forest_attention as forest_attention_module
    from engine.kernels.decode_attention import AttentionHeads, PrepInputs, attention_prep, decode_attention
    from engine.kernels.decode_gdn import conv_step, gdn_step
    from engine.kernels.decode_quant import gated_norm_quantize, swiglu_quantize
    from engine.kernels.decode_rows import PIECE_FIELDS
    from engine.kernels.decode_rows import ROW_FIELDS as DECODE_ROW_FIELDS
    from engine.kernels.draw import TABLE_SIZE, draw_tokens
    from engine.kernels.forest_attention import (
        ATTENTION_DOTS,
        LONG_FORMS,
        attention_warps,
        forest_attention,
        forest_attention_prep,
        long_configs,
    )
    from engine.kernels.forest_gdn import (
        CHUNK,
        TC_CHUNK,
        TC_DECAYED_FORMS,
        TC_DOTS,
        TC_PREP_FORMS,
        TC_WALKS,
        ChunkPrep,
        forest_conv,
        forest_gdn,
        forest_gdn_outputs,
        forest_gdn_prep,
    )
    from engine.kernels.forest_tables import QBLOCK_FIELDS, ROW_FIELDS, SEG_FIELDS
    from engine.kernels.int8_gemm import SWIGLU_CANDIDATES, SWIGLU_TABLE, int8_gemm_swiglu
    from engine.kernels.norm import norm_rows
    from engine.kernels.top_k import row_top_k
    from engine.kernels.vocab_mass import vocab_partials

    c = config
    t = rows
    h, inter = c.hidden_size, c.intermediate_size
    nh, nkv, hd = c.num_attention_heads, c.num_kv_heads, c.head_dim
    hqk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    conv_dim, width = c.conv_dim, c.conv_kernel

    def f32(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape)

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.empty(n, k, dtype=torch.int8)  # never written: the pages are never touched

    base = f32(64)
    n_pieces = 4
    with record() as launches:
        q8, scale = torch.zeros(t, h, dtype=torch.int8), f32(t)
        for m in (t, 1024):  # both tile configs of the GEMM table
            a, a_scale = torch.zeros(m, h, dtype=torch.int8), f32(m)
            for n in (h, inter, c.vocab_size):
                int8_gemm(a, weight(n, h), a_scale, f32(n), backend="triton")
            int8_gemm(a, weight(h, h), a_scale, f32(h), f32(m, h), backend="triton")
            a_inter = torch.zeros(m, inter, dtype=torch.int8)
            int8_gemm(a_inter, weight(h, inter), a_scale, f32(h), f32(m, h), backend="triton")
        # split K (the decode rows' candidate; any split gives the same bits)
        split = GemmConfig(64, 128, 128, 4, 4, split_k=4)
        int8_gemm(q8, weight(inter, h), scale, f32(inter), f32(t, inter), backend="triton", config=split)
        # stream K at decode's 16 and 64 rows (candidates there; any config gives the same bits)
        for rows_m, sk in (
            (16, GemmConfig(16, 128, 256, 4, 4, stream_k=1)),
            (64, GemmConfig(64, 128, 128, 4, 4, stream_k=1)),
        ):
            a_m, s_m = torch.zeros(rows_m, h, dtype=torch.int8), f32(rows_m)
            int8_gemm(a_m, weight(inter, h), s_m, f32(inter), backend="triton", config=sk)
            a_i = torch.zeros(rows_m, inter, dtype=torch.int8)
            int8_gemm(a_i, weight(h, inter), s_m, f32(h), f32(rows_m, h), backend="triton", config=sk)
        # decode's dp4a GEMV at 1 and 4 rows (a candidate for M <= 4; the same bits)
        for rows_m, gemv in (
            (1, GemmConfig(1, 8, 1024, 4, 1, gemv=True)),
            (4, GemmConfig(4, 8, 512, 4, 1, gemv=True)),
        ):
            a_m, s_m = torch.zeros(rows_m, h, dtype=torch.int8), f32(rows_m)
            int8_gemm(a_m, weight(inter, h), s_m, f32(inter), backend="triton", config=gemv)
            a_i = torch.zeros(rows_m, inter, dtype=torch.int8)
            int8_gemm(a_i, weight(h, inter), s_m, f32(h), f32(rows_m, h), backend="triton", config=gemv)
        # the MLP gate+up GEMM with SwiGLU in its epilogue: every fused config, the table's and
        # the sweep's candidates (any gives the same bits)
        a_sw, s_sw = torch.zeros(t, h, dtype=torch.int8), f32(t)
        for cfg in dict.fromkeys([c for _, c in SWIGLU_TABLE if c is not None] + list(SWIGLU_CANDIDATES)):
            int8_gemm_swiglu(a_sw, weight(2 * inter, h), s_sw, f32(2 * inter), backend="triton", config=cfg)
        # persistent with TMA operands (a candidate for large M; any config gives the same bits)
        tma = GemmConfig(128, 128, 128, 8, 3, persistent=True)
        int8_gemm(a_inter, weight(h, inter), a_scale, f32(h), f32(1024, h), backend="triton", config=tma)
        for k in sorted({h, inter, nh * hd, hv * dv, conv_dim}):
            quantize_rows(f32(t, k), f32(k), backend="triton")
            rms_norm_quantize(f32(t, k), f32(k), 1e-6, backend="triton")
            norm_rows(f32(t, k), f32(k), 1e-6, backend="triton")
        norm_rows(f32(t, hqk, dk), None, 1e-6, mean=False, backend="triton")
        norm_rows(f32(t, hv, dv), f32(dv), 1e-6, backend="triton")
        # the decoder's step kernels
        drows = torch.zeros(t, DECODE_ROW_FIELDS, dtype=torch.int64)
        dpieces = torch.zeros(t, n_pieces, PIECE_FIELDS, dtype=torch.int64)
        if width == 4:
            conv_step(f32(t, conv_dim), f32(conv_dim, width), base, drows, 0)
        gdn_step(
            f32(t, conv_dim), f32(t, hv), f32(t, hv), f32(hv), f32(hv), base, drows, 0,
            num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv,
        )  # fmt: skip
        rope = f32(t, 2, c.rope_dims)
        qg, k_rows, v_rows = f32(t, nh * 2 * hd), f32(t, nkv * hd), f32(t, nkv * hd)
        prep = PrepInputs(qg, k_rows, v_rows, f32(hd), f32(hd), rope)
        heads = AttentionHeads(nh, nkv, hd, 1e-6)
        q = attention_prep(prep, base, drows, dpieces, heads)
        decode_attention(f32(t, nh, hd), qg, base, drows, dpieces, num_kv_heads=nkv)
        gated_norm_quantize(f32(t, hv, dv), f32(t, hv * dv), f32(dv), f32(hv * dv), 1e-6)
        gated_form, decode_quant.GATED_FORM = decode_quant.GATED_FORM, "blocks"  # the candidate form too
        try:
            gated_norm_quantize(f32(t, hv, dv), f32(t, hv * dv), f32(dv), f32(hv * dv), 1e-6)
        finally:
            decode_quant.GATED_FORM = gated_form
        swiglu_quantize(f32(t, 2 * inter), f32(inter))  # gate and up interleaved
        split_rows, decode_quant.SPLIT_MAX_ROWS = decode_quant.SPLIT_MAX_ROWS, t  # its split form too
        try:
            swiglu_quantize(f32(t, 2 * inter), f32(inter))
        finally:
            decode_quant.SPLIT_MAX_ROWS = split_rows
        # SwiGLU's long-row kernel runs for intermediate sizes past 18,432 (no shape here has
        # one): compiled at such a row so that the kernel kept for them stays valid
        long_inter = max(inter, decode_quant.RESIDENT_VALUES * 32 * decode_quant.RESIDENT_WARPS) + 1024
        swiglu_quantize(f32(t, 2 * long_inter), f32(long_inter))
        # the forest body's kernels (all-padding tables: valid, and nothing would be touched)
        frows = torch.zeros(t, ROW_FIELDS, dtype=torch.int64)
        segs = torch.zeros(4, SEG_FIELDS, dtype=torch.int64)
        fpieces = torch.zeros(4, n_pieces, PIECE_FIELDS, dtype=torch.int64)
        qblocks = torch.zeros(t // 16 + 4, QBLOCK_FIELDS, dtype=torch.int64)
        conv_src = torch.zeros(4, width - 1, 2, dtype=torch.int64)
        forest_attention_prep(prep, base, frows, segs, fpieces, heads)
        # the body's last layer: every row's keys and values, the read rows' queries, and the
        # read rows attended by the decode kernel (unsplit with the forest kernel's warps, or split)
        forest_attention_prep(prep, base, frows, segs, fpieces, heads, part="keys")
        forest_attention_prep(prep, base, frows, segs, fpieces, heads, part="queries")
        for dots, splits in itertools.product(ATTENTION_DOTS, (1, None)):
            decode_attention(
                f32(t, nh, hd), qg, base, drows, dpieces, num_kv_heads=nkv, splits=splits, dots=dots,
                num_warps=attention_warps(hd),
            )  # fmt: skip
        for dots in ATTENTION_DOTS:
            forest_attention(
                f32(t, nh, hd), qg, base, frows, segs, fpieces, qblocks, num_kv_heads=nkv, dots=dots
            )
        # the output's dead rows zeroed alone (forest_attention.ZERO_DEAD_ROWS_ONLY, a candidate)
        zero_dead = forest_attention_module.ZERO_DEAD_ROWS_ONLY
        forest_attention_module.ZERO_DEAD_ROWS_ONLY = True
        try:
            forest_attention(
                f32(t, nh, hd), qg, base, frows, segs, fpieces, qblocks, num_kv_heads=nkv, dots="bf16"
            )
        finally:
            forest_attention_module.ZERO_DEAD_ROWS_ONLY = zero_dead
        # the ancestor split (bf16 dots; on by default since 2026-12-04: forest_attention.SPLIT_BY_DEFAULT)
        forest_attention(
            f32(t, nh, hd), qg, base, frows, segs, fpieces, qblocks, num_kv_heads=nkv, dots="bf16", split=True
        )
        # bf16 queries from the prep (forest_attention.QUERIES_BF16, the default since session 30): the prep's
        # rounding store, and every bf16-dot kernel reading them
        q16 = forest_attention_prep(prep, base, frows, segs, fpieces, heads, q_dtype=torch.bfloat16)
        forest_attention(
            q16, qg, base, frows, segs, fpieces, qblocks, num_kv_heads=nkv, dots="bf16", split=True
        )
        # the large-block tiers only launch for calls of at least their min_length rows: a call that
        # long (the tables are all padding; nothing is touched) compiles every shipped tier, with
        # fp32 queries (staged through q16 where the tier says) and with bf16 ones
        t_long = max(cfg.min_length for form in LONG_FORMS for cfg in long_configs(hd, "bf16", form))
        lrows = torch.zeros(t_long, ROW_FIELDS, dtype=torch.int64)
        lblocks = torch.zeros(t_long // 16 + 4, QBLOCK_FIELDS, dtype=torch.int64)
        lqg = f32(t_long, nh * 2 * hd)
        for q_long in (f32(t_long, nh, hd), torch.empty(t_long, nh, hd, dtype=torch.bfloat16)):
            for form in LONG_FORMS:
                forest_attention(
                    q_long, lqg, base, lrows, segs, fpieces, lblocks, num_kv_heads=nkv, dots="bf16",
                    long=long_configs(hd, "bf16", form),
                )  # fmt: skip
        # the FMHA long tier (forest_attention.FMHA_LONG_TIER, the CUDA default; head 256 only): its plan
        # kernel, the shadow that zeroes the rows it does not copy, and the ancestor fold in
        # FMHA_FOLD's blocks. `make cutlass` compiles the CUTLASS kernel itself; its torch stand-in
        # would read the unwritten plan here, so it is held off while recording
        if hd == forest_attention_module.FMHA_HEAD_DIM:
            stand_in = forest_attention_module.forest_fmha_reference
            forest_attention_module.forest_fmha_reference = lambda *args: None
            try:
                forest_attention(
                    torch.empty(t_long, nh, hd, dtype=torch.bfloat16), lqg, base, lrows, segs, fpieces,
                    lblocks, num_kv_heads=nkv, dots="bf16", fmha=True,
                )  # fmt: skip
            finally:
                forest_attention_module.forest_fmha_reference = stand_in
        # every form of the large-block tiers (forest_attention.LONG_FORMS; one is LONG_FORM)
        for form in LONG_FORMS:
            forest_attention(
                f32(t, nh, hd), qg, base, frows, segs, fpieces, qblocks, num_kv_heads=nkv, dots="bf16",
                long=long_configs(hd, "bf16", form),
            )  # fmt: skip
        forest_conv(f32(t, conv_dim), f32(conv_dim, width), base, frows, segs, conv_src, 0)
        forest_gdn(
            f32(t, conv_dim), f32(t, hv), f32(t, hv), f32(hv), f32(hv), base, segs, 0, 0, f32(t, hv, dv),
            num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv,
        )  # fmt: skip
        for dots, walk in itertools.product(TC_DOTS, TC_WALKS):  # tensor cores: prep, walk, outputs
            tc = forest_gdn_prep(
                f32(t, conv_dim), f32(t, hv), f32(t, hv), f32(hv), f32(hv), segs, qblocks,
                num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=TC_CHUNK, dots=dots, walk=walk,
            )  # fmt: skip
            forest_gdn(
                f32(t, conv_dim), f32(t, hv), f32(t, hv), f32(hv), f32(hv), base, segs, 0, 0, f32(t, hv, dv),
                num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=TC_CHUNK, dots=dots, prep=tc,
            )  # fmt: skip
        # every prep form ("invert_split": its three kernels, scores, inverse, w and u)
        for dots, form, decayed in itertools.product(TC_DOTS, TC_PREP_FORMS, TC_DECAYED_FORMS):
            forest_gdn_prep(
                f32(t, conv_dim), f32(t, hv), f32(t, hv), f32(hv), f32(hv), segs, qblocks,
                num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=TC_CHUNK, dots=dots,
                prep_form=form, decayed=decayed,
            )  # fmt: skip
        for dots, decayed in itertools.product(TC_DOTS, TC_DECAYED_FORMS):  # the body's split walk + outputs
            tc = forest_gdn_prep(
                f32(t, conv_dim), f32(t, hv), f32(t, hv), f32(hv), f32(hv), segs, qblocks,
                num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=TC_CHUNK, dots=dots,
                decayed=decayed,
            )  # fmt: skip
            out = f32(t, hv, dv)
            forest_gdn(
                f32(t, conv_dim), f32(t, hv), f32(t, hv), f32(hv), f32(hv), base, segs, 0, 0, out,
                num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=TC_CHUNK, dots=dots, prep=tc,
                outputs=False,
            )  # fmt: skip
            forest_gdn_outputs(tc, segs, out, rows=frows)  # with the padding rows' zeros
        for dots in ("ieee", "tf32"):  # the chunked form: its prep and its walk over the chunks
            forest_gdn_prep(
                f32(t, conv_dim), f32(t, hv), f32(t, hv), f32(hv), f32(hv), segs, qblocks,
                num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=CHUNK, dots=dots,
            )  # fmt: skip
            prep = ChunkPrep(CHUNK, dots, f32(t, hv, dk), f32(t, hv, dv), f32(t, hv))
            forest_gdn(
                f32(t, conv_dim), f32(t, hv), f32(t, hv), f32(hv), f32(hv), base, segs, 0, 0, f32(t, hv, dv),
                num_k_heads=hqk, num_v_heads=hv, k_dim=dk, v_dim=dv, chunk=CHUNK, dots=dots, prep=prep,
            )  # fmt: skip
        vocab_partials(f32(c.vocab_size))  # a read-out's coverage
        row_top_k(f32(64, c.vocab_size), 20, backend="triton")  # a thought's sampler (its top-k)
        # ... and its draw on the device (engine.kernels.draw: built, not yet wired into the decoder)
        packed, us = torch.empty(64, 42, dtype=torch.int64), torch.empty(64, dtype=torch.float64)
        draw_tokens(
            packed, us, 20, 0.6, 0.95, table=torch.empty(TABLE_SIZE, dtype=torch.float64), backend="triton"
        )
        del q, q8, scale
    return _dedupe(launches)
