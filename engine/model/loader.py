"""Load a qwen35 GGUF into the canonical `Weights` layout (see engine/model/weights.py).

Undoes the converter's value-head tiling (only when num_v_heads != num_k_heads) and keeps
everything else as stored: multiplicative norms, `ssm_a = -exp(A_log)`, squeezed conv
`[conv_dim, K]`. The MTP block (`blk.{num_layers}`) is not read.

Memory: F32 (and F16/BF16 when that dtype is asked for) tensors that need no permutation are
zero-copy views of the file map; quantised tensors are dequantised once, straight from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from gguf import GGMLQuantizationType

from engine.model.config import ModelConfig
from engine.model.dequant import SUPPORTED_TYPES, dequantize, numpy_bytes
from engine.model.gguf import GGUFError, GGUFFile, TensorRecord, open_gguf
from engine.model.weights import Weights, v_head_tiled_to_grouped

log = structlog.get_logger(__name__)

_ZERO_COPY: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def tensor_name(layer: int | None, key: str) -> str:
    """GGUF name of a canonical key: `ssm_a` has no suffix, `ssm_dt` is a bias."""
    suffix = "" if key == "ssm_a" else ".bias" if key == "ssm_dt" else ".weight"
    prefix = "" if layer is None else f"blk.{layer}."
    return f"{prefix}{key}{suffix}"


def expected_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Torch-order shapes of one decoder layer's tensors, keyed like `Weights.layers`."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (c.hidden_size,),
        "post_attention_norm": (c.hidden_size,),
        "ffn_gate": (c.intermediate_size, c.hidden_size),
        "ffn_up": (c.intermediate_size, c.hidden_size),
        "ffn_down": (c.hidden_size, c.intermediate_size),
    }
    if c.is_full_attention(layer):
        q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes |= {
            "attn_q": (2 * q_dim, c.hidden_size),
            "attn_k": (kv_dim, c.hidden_size),
            "attn_v": (kv_dim, c.hidden_size),
            "attn_output": (c.hidden_size, q_dim),
            "attn_q_norm": (c.head_dim,),
            "attn_k_norm": (c.head_dim,),
        }
    else:
        nv = c.linear_num_value_heads
        shapes |= {
            "attn_qkv": (c.conv_dim, c.hidden_size),
            "attn_gate": (c.linear_value_dim, c.hidden_size),
            "ssm_beta": (nv, c.hidden_size),
            "ssm_alpha": (nv, c.hidden_size),
            "ssm_conv1d": (c.conv_dim, c.conv_kernel),
            "ssm_dt": (nv,),
            "ssm_a": (nv,),
            "ssm_norm": (c.linear_value_head_dim,),
            "ssm_out": (c.hidden_size, c.linear_value_dim),
        }
    return shapes


@dataclass(frozen=True)
class VReorder:
    """GGUF -> canonical for one tensor: `canonical = stored.index_select(axis, index)`.

    A pure permutation of rows (axis 0) or input columns (axis 1, `ssm_out` only, in whole
    blocks of `linear_value_head_dim` columns), so quantised rows/blocks can be moved as-is.
    """

    axis: int
    index: torch.Tensor  # int64, length = size of `axis`


def v_reorder(config: ModelConfig, key: str) -> VReorder | None:
    """The value-head un-tiling of a linear-attention tensor, or None when it has none."""
    c = config
    if c.linear_num_value_heads == c.linear_num_key_heads:
        return None
    heads = v_head_tiled_to_grouped(c.linear_num_key_heads, c.linear_num_value_heads)
    dv = c.linear_value_head_dim
    per_head = (heads[:, None] * dv + torch.arange(dv)).reshape(-1)  # head order -> channel order
    if key in ("attn_qkv", "ssm_conv1d"):
        qk = 2 * c.linear_key_dim
        return VReorder(0, torch.cat([torch.arange(qk), qk + per_head]))
    if key == "attn_gate":
        return VReorder(0, per_head)
    if key in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
        return VReorder(0, heads)
    if key == "ssm_out":
        return VReorder(1, per_head)
    return None


def _as_file(source: str | Path | GGUFFile) -> GGUFFile:
    return source if isinstance(source, GGUFFile) else open_gguf(source)


def load_raw_tensor(source: str | Path | GGUFFile, name: str) -> TensorRecord:
    """The stored bytes of a tensor by GGUF name (no dequantisation, no reordering)."""
    return _as_file(source).tensor(name)


def _check(file: GGUFFile, rec: TensorRecord, shape: tuple[int, ...]) -> None:
    if rec.shape != shape:
        raise GGUFError(f"{file.path}: tensor {rec.name} has shape {list(rec.shape)}, expected {list(shape)}")
    if rec.ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise GGUFError(
            f"{file.path}: tensor {rec.name} has unsupported type {rec.ggml_type.name} "
            f"(supported: {supported})"
        )


def _materialise(rec: TensorRecord, dtype: torch.dtype, reorder: VReorder | None) -> torch.Tensor:
    native = _ZERO_COPY.get(rec.ggml_type)
    if native == dtype:
        t = numpy_bytes(rec.data).view(dtype).reshape(rec.shape)
    else:
        t = dequantize(rec.data, rec.ggml_type, rec.shape)
        if dtype != torch.float32:
            t = t.to(dtype)
    if reorder is not None:
        t = t.index_select(reorder.axis, reorder.index)
    return t


def load_tensor(
    source: str | Path | GGUFFile,
    key: str,
    layer: int | None = None,
    dtype: torch.dtype = torch.float32,
    config: ModelConfig | None = None,
) -> torch.Tensor:
    """One tensor in canonical layout (shape-checked, dequantised, value heads un-tiled)."""
    file = _as_file(source)
    config = config or file.config()
    rec = file.tensor(tensor_name(layer, key))
    if layer is None:
        shape = (config.hidden_size,) if key == "output_norm" else (config.vocab_size, config.hidden_size)
        reorder = None
    else:
        shape = expected_shapes(config, layer)[key]
        reorder = v_reorder(config, key)
    _check(file, rec, shape)
    return _materialise(rec, dtype, reorder)


def load_weights(source: str | Path | GGUFFile, dtype: torch.dtype = torch.float32) -> Weights:
    """All decoder weights of a qwen35 GGUF in the canonical layout, as `dtype`."""
    file = _as_file(source)
    config = file.config()
    token_embd = load_tensor(file, "token_embd", dtype=dtype, config=config)
    output = token_embd if config.tied_embeddings else load_tensor(file, "output", dtype=dtype, config=config)
    layers = [
        {key: load_tensor(file, key, i, dtype, config) for key in expected_shapes(config, i)}
        for i in range(config.num_layers)
    ]
    weights = Weights(
        config=config,
        token_embd=token_embd,
        output_norm=load_tensor(file, "output_norm", dtype=dtype, config=config),
        output=output,
        layers=layers,
    )
    types = sorted({r.ggml_type.name for r in file.tensors.values()})
    log.info("weights_loaded", path=str(file.path), layers=config.num_layers, types=types, dtype=str(dtype))
    return weights


def is_zero_copy(tensor: torch.Tensor, record: TensorRecord) -> bool:
    """True when `tensor` reads the file map's bytes of `record` directly (no copy)."""
    return tensor.data_ptr() == record.data.ctypes.data
