"""Write small random qwen35 GGUF files exactly as llama.cpp's converter and quantizer lay them out.

Weights are drawn in the canonical (HF) layout, then the converter's transforms are applied
independently of the loader: value heads tiled (`blk` tensors indexed by value head), norms
stored multiplicative, `ssm_a = -exp(A_log)`, conv squeezed to `[C, K]`. The vocabulary is
always the real 248,320-row Qwen3.5 one (`engine.testing.vocab`).

    python -m engine.testing.make_model --out m.gguf --quant Q4_K_M [--dims tiny|small]
        [--seed N] [--mtp] [--outliers N] [--mmproj mmproj-m.gguf]

`--mmproj` also writes a random vision tower as llama.cpp's projector GGUF (`write_mmproj`).

Quant mixes: `F32` (everything F32); `Q8_0` (every >=2-D weight Q8_0; norms, ssm_a, ssm_dt,
ssm_conv1d F32); `Q4_K_M` (llama.cpp's mix, see `tensor_types`). Q8_0/Q5_0 are encoded by
`gguf.quants`; Q4_K/Q6_K (which gguf-py cannot encode) by the plain quantisers below, which
produce valid blocks, not llama.cpp's error-minimising search.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import structlog
import torch
from gguf import GGMLQuantizationType

from engine.model.config import ModelConfig
from engine.model.loader import expected_shapes, tensor_name
from engine.model.weights import Weights
from engine.vision.mmproj import BLOCK_KEYS as VISION_BLOCK_KEYS
from engine.vision.mmproj import VisionConfig, VisionWeights

log = structlog.get_logger(__name__)

Q = GGMLQuantizationType
QK_K = 256
VOCAB_ROWS = 248_320
QUANTS = ("F32", "Q8_0", "Q4_K_M")
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
}

_COMMON = dict(
    vocab_size=VOCAB_ROWS,
    rope_theta=1e7,
    rms_norm_eps=1e-6,
    full_attention_interval=4,
    conv_kernel=4,
    context_length=262144,
    rope_sections=(11, 11, 10, 0),
)
DIMS: dict[str, ModelConfig] = {
    # Fast CPU tests; rows of 64 exercise the Q5_0/Q8_0 fallbacks of the Q4_K_M mix.
    "tiny": ModelConfig(
        hidden_size=64,
        num_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_dims=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        tied_embeddings=False,
        **_COMMON,
    ),
    # Rows of 256 and 512 exercise real Q4_K/Q6_K blocks; tied like the 0.8B..4B models.
    "small": ModelConfig(
        hidden_size=256,
        num_layers=8,
        intermediate_size=512,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rope_dims=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        tied_embeddings=True,
        **_COMMON,
    ),
}

NORM_KEYS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "ssm_norm")
OUTPUT_PROJ_KEYS = ("attn_output", "ssm_out", "ffn_down")
F32_ONLY_KEYS = NORM_KEYS + ("ssm_a", "ssm_dt", "ssm_conv1d")


# ---------------------------------------------------------------- canonical random weights


def canonical_random_weights(config: ModelConfig, seed: int = 0, outliers: int = 0) -> Weights:
    """Deterministic, well-conditioned random weights in the canonical layout (float32).

    Linear weights ~ N(0, 1/fan_in) (residual-writing projections further / sqrt(2 layers)),
    norms ~ 1 + N(0, 0.1²), `ssm_a` in [-16, -1], dt bias = softplus⁻¹ of dt in [1e-3, 0.1].
    `outliers` hidden channels get their pre-norm weights (and untied embedding columns)
    scaled 20-50x, the activation outliers SmoothQuant exists for.
    """
    rng = np.random.default_rng(seed)
    c = config
    resid = 1.0 / np.sqrt(2.0 * c.num_layers)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def norm(n: int) -> torch.Tensor:
        return torch.from_numpy((1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    def layer(i: int) -> dict[str, torch.Tensor]:
        w: dict[str, torch.Tensor] = {}
        for key, shape in expected_shapes(c, i).items():
            if key in NORM_KEYS:
                w[key] = norm(shape[0])
            elif key == "ssm_a":
                w[key] = torch.from_numpy(-rng.uniform(1.0, 16.0, shape).astype(np.float32))
            elif key == "ssm_dt":
                dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
                w[key] = torch.from_numpy(np.log(np.expm1(dt)).astype(np.float32))
            else:
                std = 1.0 / np.sqrt(shape[1])
                w[key] = normal(shape, std * resid if key in OUTPUT_PROJ_KEYS else std)
        return w

    h = c.hidden_size
    # Tied: the embedding is the LM head, scaled like one; untied: unit rows.
    token_embd = normal((c.vocab_size, h), 1.0 / np.sqrt(h) if c.tied_embeddings else 1.0)
    layers = [layer(i) for i in range(c.num_layers)]
    output_norm = norm(h)
    output = token_embd if c.tied_embeddings else normal((c.vocab_size, h), 1.0 / np.sqrt(h))
    if outliers:
        channels = torch.from_numpy(rng.choice(h, size=outliers, replace=False))
        factors = torch.from_numpy(rng.uniform(20.0, 50.0, outliers).astype(np.float32))
        for w in layers:
            for key in ("attn_norm", "post_attention_norm"):
                w[key][channels] *= factors
        if not c.tied_embeddings:
            token_embd[:, channels] *= factors
    return Weights(config=c, token_embd=token_embd, output_norm=output_norm, output=output, layers=layers)


def _mtp_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h = config.hidden_size
    nextn = {
        "nextn.eh_proj": (h, 2 * h),
        "nextn.enorm": (h,),
        "nextn.hnorm": (h,),
        "nextn.shared_head_norm": (h,),
    }
    # The MTP layer is a full-attention decoder layer; any attention layer index gives its shapes.
    return nextn | expected_shapes(config, config.full_attention_interval - 1)


def mtp_tensor_name(config: ModelConfig, key: str) -> str:
    """GGUF name of an MTP-block tensor: the block after the last decoder layer."""
    if key.startswith("nextn."):
        return f"blk.{config.num_layers}.{key}.weight"
    return tensor_name(config.num_layers, key)


def mtp_random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The MTP block's tensors (key -> tensor): nextn.* plus a full-attention layer's."""
    rng = np.random.default_rng(seed + 1)
    out: dict[str, torch.Tensor] = {}
    for key, shape in _mtp_shapes(config).items():
        if len(shape) == 1:
            out[key] = torch.from_numpy((1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            std = np.float32(1.0 / np.sqrt(shape[1]))
            out[key] = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * std)
    return out


# ---------------------------------------------------------------- converter transforms


def tile_v_heads(config: ModelConfig, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """Canonical (grouped) value-head order -> GGUF (tiled) order, as the converter writes it.

    Tiled position `p = r * num_k + k` holds grouped head `k * ratio + r`, so that ggml can
    broadcast key heads with a plain repeat.
    """
    c = config
    nk, nv, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_value_head_dim
    if nk == nv or key not in (
        "attn_qkv",
        "ssm_conv1d",
        "attn_gate",
        "ssm_alpha",
        "ssm_beta",
        "ssm_a",
        "ssm_dt",
        "ssm_out",
    ):
        return tensor
    ratio = nv // nk
    src_head = [(p % nk) * ratio + p // nk for p in range(nv)]
    if key in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
        return tensor[src_head]
    channels = [h * dv + j for h in src_head for j in range(dv)]
    if key == "attn_gate":
        return tensor[channels]
    if key == "ssm_out":
        return tensor[:, channels]
    qk = 2 * c.linear_key_dim  # attn_qkv / ssm_conv1d: q and k channels first, then v
    return torch.cat([tensor[:qk], tensor[qk:][channels]])


# ---------------------------------------------------------------- quantisation


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of layers that keep more bits in the *_M mixes (C integer division)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(qtype: GGMLQuantizationType, row: int) -> GGMLQuantizationType:
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) and row % QK_K:
        return {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}[qtype]
    return qtype


def tensor_types(config: ModelConfig, quant: str, mtp: bool = False) -> dict[str, GGMLQuantizationType]:
    """Per-tensor ggml type of every tensor in a generated file, by GGUF name."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; choose one of {', '.join(QUANTS)}")
    shapes = gguf_shapes(config, mtp)
    types: dict[str, GGMLQuantizationType] = {}
    attn_v_like = [n for n in shapes if n.endswith(("attn_v.weight", "attn_qkv.weight"))]
    ffn_down = [n for n in shapes if n.endswith("ffn_down.weight")]
    for name, shape in shapes.items():
        key = name.split(".")[-2] if name.endswith((".weight", ".bias")) else name.split(".")[-1]
        if len(shape) < 2 or key in F32_ONLY_KEYS or quant == "F32":
            types[name] = Q.F32
            continue
        if quant == "Q8_0":
            types[name] = Q.Q8_0
            continue
        # The LM head (and the embedding when it doubles as one) keeps 6 bits; so do attn_v-like
        # tensors and ffn_down on llama.cpp's "more bits" layers.
        head = name == "output.weight" or (name == "token_embd.weight" and config.tied_embeddings)
        more_bits = any(
            name in group and use_more_bits(group.index(name), len(group))
            for group in (attn_v_like, ffn_down)
        )
        types[name] = _fallback(Q.Q6_K if head or more_bits else Q.Q4_K, shape[-1])
    return types


def gguf_shapes(config: ModelConfig, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Torch-order shapes of every tensor a generated file holds, in file order."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        for key, shape in expected_shapes(c, i).items():
            shapes[tensor_name(i, key)] = shape
    if mtp:
        for key, shape in _mtp_shapes(c).items():
            shapes[mtp_tensor_name(c, key)] = shape
    shapes["output_norm.weight"] = (c.hidden_size,)
    if not c.tied_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _pack_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8).reshape(x.shape[0], 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 210] Q6_K bytes: 16 signed 8-bit sub-scales of 16 values."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31  # per sub-block; q in [-31, 31] fits the 6-bit [-32, 31]
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    eff = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    q = (np.clip(np.rint(_safe_div(x, eff[..., None])), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, 2, 4, 32)  # half h, group k, lane t: value index h*128 + k*32 + t
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _pack_f16(d)], axis=1)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] Q4_K bytes: x = d*sc*q - dmin*m over 8 sub-blocks of 32."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 15
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_safe_div(-lo, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    eff_d = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    eff_m = dmin.astype(np.float32)[:, None] * m.astype(np.float32)
    q = np.clip(np.rint(_safe_div(x + eff_m[..., None], eff_d[..., None])), 0, 15).astype(np.uint8)
    scales = np.concatenate(
        [
            (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    return np.concatenate([_pack_f16(d), _pack_f16(dmin), scales, qs], axis=1)


_OWN_QUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}


def quantize(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Encode float32 rows (last axis = ggml row) as `qtype`: uint8 `[*rows, row_bytes]`,
    or the float array itself for F32/F16."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    own = _OWN_QUANTIZERS.get(qtype)
    if own is None:
        return gguf.quants.quantize(array, qtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if array.shape[-1] % block:
        raise ValueError(f"rows of {array.shape[-1]} are not whole {qtype.name} blocks")
    flat = array.reshape(-1, block)
    out = np.empty((flat.shape[0], type_size), dtype=np.uint8)
    step = 1 << 16
    for s in range(0, flat.shape[0], step):
        out[s : s + step] = own(flat[s : s + step])
    return out.reshape(*array.shape[:-1], array.shape[-1] // block * type_size)


# ---------------------------------------------------------------- writing


def _gguf_tensors(weights: Weights, mtp: dict[str, torch.Tensor] | None) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in GGUF (tiled) layout, in file order."""
    c = weights.config
    out: dict[str, np.ndarray] = {"token_embd.weight": weights.token_embd.numpy()}
    for i, layer in enumerate(weights.layers):
        for key, t in layer.items():
            out[tensor_name(i, key)] = tile_v_heads(c, key, t).numpy()
    if mtp is not None:
        for key, t in mtp.items():
            out[mtp_tensor_name(c, key)] = t.numpy()
    out["output_norm.weight"] = weights.output_norm.numpy()
    if not c.tied_embeddings:
        out["output.weight"] = weights.output.numpy()
    return out


def _write_metadata(w: gguf.GGUFWriter, c: ModelConfig, quant: str, mtp: bool, vocab: Any) -> None:
    arch = "qwen35"
    w.add_string("general.name", f"prism-test-{arch}")
    w.add_file_type(int(FILE_TYPES[quant]))
    if quant != "F32":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_uint32(f"{arch}.block_count", c.num_layers + (1 if mtp else 0))
    w.add_uint32(f"{arch}.context_length", c.context_length)
    w.add_uint32(f"{arch}.embedding_length", c.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", c.intermediate_size)
    w.add_uint32(f"{arch}.vocab_size", c.vocab_size)
    w.add_uint32(f"{arch}.attention.head_count", c.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", c.num_kv_heads)
    w.add_uint32(f"{arch}.attention.key_length", c.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", c.head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_theta)
    w.add_uint32(f"{arch}.rope.dimension_count", c.rope_dims)
    w.add_array(f"{arch}.rope.dimension_sections", list(c.rope_sections))
    w.add_uint32(f"{arch}.full_attention_interval", c.full_attention_interval)
    w.add_uint32(f"{arch}.ssm.conv_kernel", c.conv_kernel)
    w.add_uint32(f"{arch}.ssm.state_size", c.linear_key_head_dim)
    w.add_uint32(f"{arch}.ssm.group_count", c.linear_num_key_heads)
    w.add_uint32(f"{arch}.ssm.time_step_rank", c.linear_num_value_heads)
    w.add_uint32(f"{arch}.ssm.inner_size", c.linear_value_dim)
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    vocab.write_to(w)


def _write_atomic(out: Path, arch: str, fill: Callable[[gguf.GGUFWriter], None]) -> None:
    """A GGUF of `arch` whose metadata and tensors `fill` adds, renamed into place only when whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".part", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        fill(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_gguf(
    out: str | Path,
    weights: Weights,
    quant: str = "F32",
    mtp: dict[str, torch.Tensor] | None = None,
    vocab: Any = None,
) -> Path:
    """Write `weights` (canonical layout) as a qwen35 GGUF with the `quant` mix; atomic rename."""
    c = weights.config
    if vocab is None:
        from engine.testing.vocab import qwen35_vocab

        vocab = qwen35_vocab()
    if len(vocab.tokens) != c.vocab_size:
        raise ValueError(f"vocabulary has {len(vocab.tokens)} tokens, the model {c.vocab_size} rows")
    types = tensor_types(c, quant, mtp is not None)

    def fill(w: gguf.GGUFWriter) -> None:
        _write_metadata(w, c, quant, mtp is not None, vocab)
        for name, array in _gguf_tensors(weights, mtp).items():
            qtype = types[name]
            data = quantize(array, qtype)
            w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)

    out = Path(out)
    _write_atomic(out, "qwen35", fill)
    log.info("model_written", path=str(out), quant=quant, layers=c.num_layers, mtp=mtp is not None)
    return out


def make_model(
    out: str | Path,
    quant: str = "F32",
    dims: str | ModelConfig = "tiny",
    seed: int = 0,
    mtp: bool = False,
    outliers: int = 0,
    vocab: Any = None,
) -> Path:
    """Generate random canonical weights and write them as a qwen35 GGUF at `out`."""
    config = DIMS[dims] if isinstance(dims, str) else dims
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; choose one of {', '.join(QUANTS)}")
    if not 0 <= outliers <= config.hidden_size:
        raise ValueError(f"outliers must be in 0..{config.hidden_size}, got {outliers}")
    weights = canonical_random_weights(config, seed, outliers)
    return write_gguf(out, weights, quant, mtp_random_weights(config, seed) if mtp else None, vocab)


# ---------------------------------------------------------------- vision projector (mmproj)


def vision_config_for(text: ModelConfig, **overrides: Any) -> VisionConfig:
    """A tiny Qwen3.5-shaped vision tower for `text` (real patch size and merge, small widths)."""
    fields = dict(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        out_hidden_size=text.hidden_size,
        num_position_embeddings=64,
        layer_norm_eps=1e-6,
        image_mean=(0.5, 0.5, 0.5),
        image_std=(0.5, 0.5, 0.5),
    )
    fields.update(overrides)
    return VisionConfig(**fields)  # type: ignore[arg-type]


def random_vision_weights(config: VisionConfig, seed: int = 0) -> VisionWeights:
    """Deterministic random tower weights in transformers' layout (Linear [out, in], Conv3d kernel)."""
    rng = np.random.default_rng(seed + 7919)  # its own stream: the text weights stay those of `seed`

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def norm(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.from_numpy((1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)),
            normal((n,), 0.02),
        )

    c = config
    h, m = c.hidden_size, c.hidden_size * c.spatial_merge_size**2
    resid = 1.0 / np.sqrt(2.0 * c.num_layers)
    blocks = []
    for _ in range(c.num_layers):
        b: dict[str, torch.Tensor] = {}
        b["ln1_w"], b["ln1_b"] = norm(h)
        b["ln2_w"], b["ln2_b"] = norm(h)
        for key, (out, inp, std) in {
            "attn_qkv": (3 * h, h, 1.0),
            "attn_out": (h, h, resid),
            "ffn_up": (c.intermediate_size, h, 1.0),
            "ffn_down": (h, c.intermediate_size, resid),
        }.items():
            b[f"{key}_w"] = normal((out, inp), std / np.sqrt(inp))
            b[f"{key}_b"] = normal((out,), 0.02)
        blocks.append(b)
    post_w, post_b = norm(h)
    return VisionWeights(
        config=c,
        patch_embd=normal(
            (h, 3, c.temporal_patch_size, c.patch_size, c.patch_size), 1.0 / np.sqrt(c.patch_dim)
        ),
        patch_bias=normal((h,), 0.02),
        pos_embd=normal((c.num_position_embeddings, h), 0.5),
        blocks=blocks,
        post_ln_w=post_w,
        post_ln_b=post_b,
        mm0_w=normal((m, m), 1.0 / np.sqrt(m)),
        mm0_b=normal((m,), 0.02),
        mm2_w=normal((c.out_hidden_size, m), 1.0 / np.sqrt(m)),
        mm2_b=normal((c.out_hidden_size,), 0.02),
    )


def _mmproj_tensors(w: VisionWeights) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, as llama.cpp's converter lays the tower out (Conv3d cut in time)."""
    out: dict[str, np.ndarray] = {
        "v.patch_embd.weight": w.patch_embd[:, :, 0].contiguous().numpy(),
        "v.patch_embd.weight.1": w.patch_embd[:, :, 1].contiguous().numpy(),
        "v.patch_embd.bias": w.patch_bias.numpy(),
        "v.position_embd.weight": w.pos_embd.numpy(),
    }
    for i, b in enumerate(w.blocks):
        for key in VISION_BLOCK_KEYS:
            out[f"v.blk.{i}.{key}.weight"] = b[f"{key}_w"].numpy()
            out[f"v.blk.{i}.{key}.bias"] = b[f"{key}_b"].numpy()
    out["v.post_ln.weight"] = w.post_ln_w.numpy()
    out["v.post_ln.bias"] = w.post_ln_b.numpy()
    out["mm.0.weight"], out["mm.0.bias"] = w.mm0_w.numpy(), w.mm0_b.numpy()
    out["mm.2.weight"], out["mm.2.bias"] = w.mm2_w.numpy(), w.mm2_b.numpy()
    return out


def write_mmproj(out: str | Path, weights: VisionWeights, quant: str = "F32") -> Path:
    """Write the tower as llama.cpp's `clip` mmproj GGUF (projector `qwen3vl_merger`); atomic rename.

    `quant` "F32" stores every tensor F32; "F16" stores 2-D and larger weights F16 (what llama.cpp's
    default mmproj conversion does), norms and biases F32."""
    if quant not in ("F32", "F16"):
        raise ValueError(f"mmproj quant must be F32 or F16, got {quant!r}")
    c = weights.config
    out = Path(out)

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_string("general.name", "prism-test-qwen35-mmproj")
        w.add_file_type(int(gguf.LlamaFileType.ALL_F32 if quant == "F32" else gguf.LlamaFileType.MOSTLY_F16))
        w.add_clip_has_vision_encoder(True)
        w.add_clip_projector_type("qwen3vl_merger")
        w.add_vision_image_size(c.grid_side * c.patch_size)
        w.add_vision_patch_size(c.patch_size)
        w.add_vision_embedding_length(c.hidden_size)
        w.add_vision_feed_forward_length(c.intermediate_size)
        w.add_vision_projection_dim(c.out_hidden_size)
        w.add_vision_block_count(c.num_layers)
        w.add_vision_head_count(c.num_heads)
        w.add_vision_attention_layernorm_eps(c.layer_norm_eps)
        w.add_vision_image_mean(list(c.image_mean))
        w.add_vision_image_std(list(c.image_std))
        w.add_vision_use_gelu(True)
        w.add_vision_spatial_merge_size(c.spatial_merge_size)
        for name, array in _mmproj_tensors(weights).items():
            if quant == "F16" and array.ndim >= 2:
                w.add_tensor(name, array.astype(np.float16))
            else:
                w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    _write_atomic(out, "clip", fill)
    log.info("mmproj_written", path=str(out), quant=quant, layers=c.num_layers)
    return out


def make_mmproj(out: str | Path, text: ModelConfig, seed: int = 0, quant: str = "F32") -> Path:
    """A random tower matching `text` (its hidden size), written as an mmproj GGUF at `out`."""
    return write_mmproj(out, random_vision_weights(vision_config_for(text), seed), quant)


def dims_config(name: str, **overrides: Any) -> ModelConfig:
    """A named generator config (`tiny`, `small`), optionally with fields replaced."""
    if name not in DIMS:
        raise ValueError(f"unknown dims {name!r}; choose one of {', '.join(DIMS)}")
    return replace(DIMS[name], **overrides)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m engine.testing.make_model", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--quant", choices=QUANTS, default="F32")
    p.add_argument("--dims", choices=sorted(DIMS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp", action="store_true", help="add the MTP block (nextn_predict_layers=1)")
    p.add_argument("--outliers", type=int, default=0, help="hidden channels with 20-50x activation outliers")
    p.add_argument(
        "--mmproj", type=Path, default=None, help="also write a matching vision projector GGUF here"
    )
    a = p.parse_args(argv)
    try:
        make_model(a.out, a.quant, a.dims, a.seed, a.mtp, a.outliers)
        if a.mmproj is not None:
            make_mmproj(a.mmproj, DIMS[a.dims], a.seed)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
