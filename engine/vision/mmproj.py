"""The vision projector GGUF ("mmproj") that llama.cpp's multimodal tools load beside a text model.

llama.cpp's converter writes Qwen3.5's (and Qwen3-VL's) vision tower as a separate file of
architecture `clip` with `clip.projector_type = "qwen3vl_merger"`. What it stores, and how that
maps back to transformers' `Qwen3_5VisionModel` (the layout `VisionWeights` keeps):

    v.patch_embd.weight, .weight.1   the Conv3d kernel [hidden, 3, 2, p, p] cut along time into two
                                     2-D kernels [hidden, 3, p, p] (time step 0, time step 1)
    v.patch_embd.bias                [hidden]
    v.position_embd.weight           learned square grid of absolute positions [side*side, hidden]
    v.blk.N.ln1 / ln2 .weight/.bias  LayerNorms before attention / MLP
    v.blk.N.attn_qkv .weight/.bias   fused q|k|v [3*hidden, hidden]
    v.blk.N.attn_out .weight/.bias   [hidden, hidden]
    v.blk.N.ffn_up / ffn_down        MLP linear_fc1 / linear_fc2 (tanh GELU between)
    v.post_ln .weight/.bias          the merger's LayerNorm (before the 2x2 patches are merged)
    mm.0 / mm.2 .weight/.bias        the merger's linear_fc1 / linear_fc2 (exact GELU between)

Metadata read: `clip.vision.{embedding_length, feed_forward_length, block_count, projection_dim,
patch_size, spatial_merge_size, attention.head_count, attention.layer_norm_epsilon, image_mean,
image_std}` and, when present, `clip.vision.image_{min,max}_pixels`. Deepstack layers
(Qwen3-VL) are refused: Qwen3.5 has none, and silently dropping them would give wrong images.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import structlog
import torch

from engine.model.dequant import SUPPORTED_TYPES, dequantize
from engine.model.gguf import GGUFError, GGUFFile, open_gguf

log = structlog.get_logger(__name__)

ARCHITECTURE = "clip"
PROJECTOR_TYPE = "qwen3vl_merger"
# Qwen3.5's preprocessor_config.json: shortest_edge / longest_edge in pixels (64 .. 16,384 merged
# tokens). Used when the file names no bounds; `Engine` may lower the maximum for serving.
DEFAULT_MIN_PIXELS = 65_536
DEFAULT_MAX_PIXELS = 16_777_216
VISION_ROPE_THETA = 10_000.0  # transformers' default for this tower; llama.cpp hard-codes it too
TEMPORAL_PATCH = 2  # the format stores exactly two time steps of the Conv3d kernel

BLOCK_KEYS = ("ln1", "ln2", "attn_qkv", "attn_out", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # the text model's hidden size
    num_position_embeddings: int
    layer_norm_eps: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    rope_theta: float = VISION_ROPE_THETA
    temporal_patch_size: int = TEMPORAL_PATCH

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """Side of the learned square position grid."""
        return int(round(self.num_position_embeddings**0.5))

    @property
    def factor(self) -> int:
        """Image sides are resized to multiples of this (a merged token covers factor x factor pixels)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass
class VisionWeights:
    """The tower in transformers' layout (Linear weights [out, in]); every tensor float32."""

    config: VisionConfig
    patch_embd: torch.Tensor  # [hidden, 3, T, p, p]: both time steps again, as the Conv3d had them
    patch_bias: torch.Tensor
    pos_embd: torch.Tensor  # [side*side, hidden]
    blocks: list[dict[str, torch.Tensor]]  # BLOCK_KEYS + "_w"/"_b"
    post_ln_w: torch.Tensor
    post_ln_b: torch.Tensor
    mm0_w: torch.Tensor
    mm0_b: torch.Tensor
    mm2_w: torch.Tensor
    mm2_b: torch.Tensor
    source: str = ""  # the file it was read from

    def to(self, device: torch.device | str) -> VisionWeights:
        """A copy on `device` (the tower runs where the text model runs)."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {k: t.to(device) for k, t in tensors.items() if isinstance(t, torch.Tensor)}
        blocks = [{k: t.to(device) for k, t in b.items()} for b in self.blocks]
        return replace(self, blocks=blocks, **moved)


def find_mmproj(model_path: str | Path) -> Path | None:
    """The projector beside a text model, by llama.cpp's naming: `mmproj-*.gguf` (or `*mmproj*.gguf`)
    in the model's directory. One candidate is taken; several that share the model's stem prefer
    the one naming it; otherwise None (ambiguous: pass `--mmproj`)."""
    model_path = Path(model_path)
    folder = model_path.parent
    found = sorted(p for p in folder.glob("*.gguf") if "mmproj" in p.name.lower() and p != model_path)
    if len(found) == 1:
        return found[0]
    stem = model_path.stem.split("-Q")[0].lower()
    named = [p for p in found if stem and stem in p.name.lower()]
    if len(named) == 1:
        return named[0]
    if found:
        log.warning("mmproj_ambiguous", model=str(model_path), candidates=[p.name for p in found])
    return None


def _meta(file: GGUFFile, key: str, default: Any = None) -> Any:
    value = file.metadata.get(key, default)
    if value is None:
        raise GGUFError(f"{file.path}: missing metadata key {key} (not a Qwen3.5 vision projector)")
    return value


def config_from_file(file: GGUFFile) -> VisionConfig:
    """The tower's shape from an mmproj file, with a clear error for any other projector."""
    if file.architecture != ARCHITECTURE:
        raise GGUFError(
            f"{file.path}: architecture {file.architecture!r}, expected {ARCHITECTURE!r} (mmproj)"
        )
    if not file.metadata.get("clip.has_vision_encoder", True):
        raise GGUFError(f"{file.path}: this projector has no vision encoder")
    projector = file.metadata.get("clip.projector_type") or file.metadata.get("clip.vision.projector_type")
    if projector != PROJECTOR_TYPE:
        raise GGUFError(f"{file.path}: projector type {projector!r}, expected {PROJECTOR_TYPE!r} (Qwen3.5)")
    if any(file.metadata.get("clip.vision.is_deepstack_layers", [])):
        raise GGUFError(f"{file.path}: deepstack layers (Qwen3-VL) are not part of Qwen3.5's tower")
    if "v.position_embd.weight" not in file.tensors:
        raise GGUFError(f"{file.path}: missing tensor v.position_embd.weight")
    mean = tuple(float(x) for x in _meta(file, "clip.vision.image_mean"))
    std = tuple(float(x) for x in _meta(file, "clip.vision.image_std"))
    if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
        raise GGUFError(f"{file.path}: image_mean/std must be 3 values (std > 0), got {mean} / {std}")
    config = VisionConfig(
        hidden_size=int(_meta(file, "clip.vision.embedding_length")),
        intermediate_size=int(_meta(file, "clip.vision.feed_forward_length")),
        num_layers=int(_meta(file, "clip.vision.block_count")),
        num_heads=int(_meta(file, "clip.vision.attention.head_count")),
        patch_size=int(_meta(file, "clip.vision.patch_size")),
        spatial_merge_size=int(_meta(file, "clip.vision.spatial_merge_size", 2)),
        out_hidden_size=int(_meta(file, "clip.vision.projection_dim")),
        num_position_embeddings=int(file.tensor("v.position_embd.weight").shape[0]),
        layer_norm_eps=float(_meta(file, "clip.vision.attention.layer_norm_epsilon", 1e-6)),
        image_mean=mean,  # type: ignore[arg-type]
        image_std=std,  # type: ignore[arg-type]
        min_pixels=int(file.metadata.get("clip.vision.image_min_pixels", DEFAULT_MIN_PIXELS)),
        max_pixels=int(file.metadata.get("clip.vision.image_max_pixels", DEFAULT_MAX_PIXELS)),
    )
    if config.hidden_size % config.num_heads or config.head_dim % 4:
        raise GGUFError(
            f"{file.path}: head size {config.hidden_size}/{config.num_heads} must be a multiple of 4"
        )
    if config.grid_side**2 != config.num_position_embeddings:
        raise GGUFError(
            f"{file.path}: {config.num_position_embeddings} position embeddings are not a square grid"
        )
    return config


def expected_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape (torch order) of every tensor the tower reads."""
    h, p, m = c.hidden_size, c.patch_size, c.hidden_size * c.spatial_merge_size**2
    shapes: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (h, 3, p, p),
        "v.patch_embd.weight.1": (h, 3, p, p),
        "v.patch_embd.bias": (h,),
        "v.position_embd.weight": (c.num_position_embeddings, h),
        "v.post_ln.weight": (h,),
        "v.post_ln.bias": (h,),
        "mm.0.weight": (m, m),
        "mm.0.bias": (m,),
        "mm.2.weight": (c.out_hidden_size, m),
        "mm.2.bias": (c.out_hidden_size,),
    }
    block = {
        "ln1": ((h,), (h,)),
        "ln2": ((h,), (h,)),
        "attn_qkv": ((3 * h, h), (3 * h,)),
        "attn_out": ((h, h), (h,)),
        "ffn_up": ((c.intermediate_size, h), (c.intermediate_size,)),
        "ffn_down": ((h, c.intermediate_size), (h,)),
    }
    for i in range(c.num_layers):
        for key, (w, b) in block.items():
            shapes[f"v.blk.{i}.{key}.weight"] = w
            shapes[f"v.blk.{i}.{key}.bias"] = b
    return shapes


def load_mmproj(path: str | Path) -> VisionWeights:
    """Read and check an mmproj GGUF; every tensor dequantized to float32 (F32/F16/BF16/Q8_0...)."""
    file = open_gguf(path)
    config = config_from_file(file)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        rec = file.tensor(name)
        if rec.shape != shape:
            raise GGUFError(f"{file.path}: tensor {name} has shape {list(rec.shape)}, expected {list(shape)}")
        if rec.ggml_type not in SUPPORTED_TYPES:
            raise GGUFError(f"{file.path}: tensor {name} has unsupported type {rec.ggml_type.name}")
        tensors[name] = dequantize(rec.data, rec.ggml_type, rec.shape).float().reshape(shape).contiguous()
    blocks = [
        {
            f"{k}_{s}": tensors[f"v.blk.{i}.{k}.{'weight' if s == 'w' else 'bias'}"]
            for k in BLOCK_KEYS
            for s in "wb"
        }
        for i in range(config.num_layers)
    ]
    weights = VisionWeights(
        config=config,
        patch_embd=torch.stack([tensors["v.patch_embd.weight"], tensors["v.patch_embd.weight.1"]], dim=2),
        patch_bias=tensors["v.patch_embd.bias"],
        pos_embd=tensors["v.position_embd.weight"],
        blocks=blocks,
        post_ln_w=tensors["v.post_ln.weight"],
        post_ln_b=tensors["v.post_ln.bias"],
        mm0_w=tensors["mm.0.weight"],
        mm0_b=tensors["mm.0.bias"],
        mm2_w=tensors["mm.2.weight"],
        mm2_b=tensors["mm.2.bias"],
        source=str(file.path),
    )
    log.info("mmproj_loaded", path=str(file.path), layers=config.num_layers, hidden=config.hidden_size)
    return weights
