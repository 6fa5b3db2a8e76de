"""Build a HF transformers `Qwen3_5ForCausalLM` from canonical `Weights` (test oracle only).

The conversion is the inverse of what the GGUF converter did on top of HF's checkpoint:
zero-centred norms get their `+1` removed (`ssm_norm` never had one), `A_log = log(-ssm_a)`,
the conv weight regains its `[C, 1, K]` shape. Canonical value heads are already in HF's
grouped order, so no head permutation is needed here.

HF is pinned to its pure-torch paths: eager attention, and the torch fallbacks of the GDN and
conv kernels (used whenever `fla` / `causal-conv1d` are absent, as in this project's venv).
"""

from __future__ import annotations

import torch
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

from engine.model.config import ModelConfig
from engine.model.weights import Weights
from engine.vision.mmproj import VisionConfig, VisionWeights


def to_hf_config(config: ModelConfig) -> Qwen3_5TextConfig:
    """HF text config equivalent to `config` (text only, so MRoPE sections do not change results)."""
    if config.rope_dims % 2 or config.rope_dims > config.head_dim:
        raise ValueError(f"rope_dims {config.rope_dims} must be even and at most head_dim {config.head_dim}")
    partial_rotary_factor = config.rope_dims / config.head_dim
    if int(config.head_dim * partial_rotary_factor) != config.rope_dims:
        raise ValueError(
            f"HF cannot express rope_dims {config.rope_dims} of head_dim {config.head_dim} exactly"
        )
    layer_types = [
        "full_attention" if config.is_full_attention(i) else "linear_attention"
        for i in range(config.num_layers)
    ]
    hf = Qwen3_5TextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.context_length,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tied_embeddings,
        attention_bias=False,
        linear_conv_kernel_dim=config.conv_kernel,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        layer_types=layer_types,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": partial_rotary_factor,
            "mrope_section": list(config.rope_sections[:3]),
            "mrope_interleaved": True,
        },
    )
    hf._attn_implementation = "eager"
    return hf


def to_hf_state_dict(weights: Weights) -> dict[str, torch.Tensor]:
    """Canonical tensors under HF `Qwen3_5ForCausalLM` parameter names, in HF's conventions."""
    config = weights.config
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": weights.token_embd,
        "model.norm.weight": weights.output_norm - 1.0,
        "lm_head.weight": weights.output,
    }
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = layer["attn_norm"] - 1.0
        sd[p + "post_attention_layernorm.weight"] = layer["post_attention_norm"] - 1.0
        sd[p + "mlp.gate_proj.weight"] = layer["ffn_gate"]
        sd[p + "mlp.up_proj.weight"] = layer["ffn_up"]
        sd[p + "mlp.down_proj.weight"] = layer["ffn_down"]
        if config.is_full_attention(i):
            a = p + "self_attn."
            sd[a + "q_proj.weight"] = layer["attn_q"]
            sd[a + "k_proj.weight"] = layer["attn_k"]
            sd[a + "v_proj.weight"] = layer["attn_v"]
            sd[a + "o_proj.weight"] = layer["attn_output"]
            sd[a + "q_norm.weight"] = layer["attn_q_norm"] - 1.0
            sd[a + "k_norm.weight"] = layer["attn_k_norm"] - 1.0
        else:
            if bool((layer["ssm_a"] >= 0).any()):
                raise ValueError(f"layer {i}: ssm_a must be negative (it is -exp(A_log))")
            a = p + "linear_attn."
            sd[a + "in_proj_qkv.weight"] = layer["attn_qkv"]
            sd[a + "in_proj_z.weight"] = layer["attn_gate"]
            sd[a + "in_proj_b.weight"] = layer["ssm_beta"]
            sd[a + "in_proj_a.weight"] = layer["ssm_alpha"]
            sd[a + "conv1d.weight"] = layer["ssm_conv1d"][:, None, :]
            sd[a + "dt_bias"] = layer["ssm_dt"]
            sd[a + "A_log"] = torch.log(-layer["ssm_a"])
            sd[a + "norm.weight"] = layer["ssm_norm"]
            sd[a + "out_proj.weight"] = layer["ssm_out"]
    return sd


def to_hf_model(weights: Weights, dtype: torch.dtype = torch.float32) -> Qwen3_5ForCausalLM:
    """HF model in eval mode carrying `weights`, every parameter in `dtype`."""
    config = weights.config
    if len(weights.layers) != config.num_layers:
        raise ValueError(f"weights have {len(weights.layers)} layers, config says {config.num_layers}")
    model = Qwen3_5ForCausalLM(to_hf_config(config))
    sd = {name: t.to(dtype) for name, t in to_hf_state_dict(weights).items()}
    model.to(dtype)
    model.load_state_dict(sd, strict=True)
    return model.eval()


# ---------------------------------------------------------------- vision (Qwen3_5ForConditionalGeneration)


def to_hf_vision_config(vision: VisionConfig) -> dict:
    """HF `Qwen3_5VisionConfig` fields for `vision` (no deepstack: Qwen3.5 has none)."""
    return {
        "depth": vision.num_layers,
        "hidden_size": vision.hidden_size,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": vision.intermediate_size,
        "num_heads": vision.num_heads,
        "in_channels": 3,
        "patch_size": vision.patch_size,
        "spatial_merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "out_hidden_size": vision.out_hidden_size,
        "num_position_embeddings": vision.num_position_embeddings,
        "rope_parameters": {"rope_type": "axial", "rope_theta": vision.rope_theta},
    }


def to_hf_vision_state_dict(vision: VisionWeights) -> dict[str, torch.Tensor]:
    """Tower tensors under HF `Qwen3_5Model.visual` names (the Conv3d kernel is whole again)."""
    sd = {
        "patch_embed.proj.weight": vision.patch_embd,
        "patch_embed.proj.bias": vision.patch_bias,
        "pos_embed.weight": vision.pos_embd,
        "merger.norm.weight": vision.post_ln_w,
        "merger.norm.bias": vision.post_ln_b,
        "merger.linear_fc1.weight": vision.mm0_w,
        "merger.linear_fc1.bias": vision.mm0_b,
        "merger.linear_fc2.weight": vision.mm2_w,
        "merger.linear_fc2.bias": vision.mm2_b,
    }
    names = {
        "ln1": "norm1",
        "ln2": "norm2",
        "attn_qkv": "attn.qkv",
        "attn_out": "attn.proj",
        "ffn_up": "mlp.linear_fc1",
        "ffn_down": "mlp.linear_fc2",
    }
    for i, b in enumerate(vision.blocks):
        for ours, theirs in names.items():
            sd[f"blocks.{i}.{theirs}.weight"] = b[f"{ours}_w"]
            sd[f"blocks.{i}.{theirs}.bias"] = b[f"{ours}_b"]
    return sd


def to_hf_vl_model(
    weights: Weights, vision: VisionWeights, token_ids: dict[str, int]
) -> Qwen3_5ForConditionalGeneration:
    """HF `Qwen3_5ForConditionalGeneration` (eval, fp32, eager) carrying the text and vision weights.

    `token_ids` names the special tokens HF locates images by: image_token_id, video_token_id,
    vision_start_token_id, vision_end_token_id."""
    text = to_hf_config(weights.config)
    config = Qwen3_5Config(
        text_config=text.to_dict(),
        vision_config=to_hf_vision_config(vision.config),
        tie_word_embeddings=weights.config.tied_embeddings,
        **token_ids,
    )
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    model = Qwen3_5ForConditionalGeneration(config)
    sd = {}
    for name, t in to_hf_state_dict(weights).items():
        sd[
            "lm_head.weight"
            if name == "lm_head.weight"
            else name.replace("model.", "model.language_model.", 1)
        ] = t
    for name, t in to_hf_vision_state_dict(vision).items():
        sd["model.visual." + name] = t
    model.float()
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    return model.eval()
