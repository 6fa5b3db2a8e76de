"""Model configuration of a qwen35 (Qwen3.5 hybrid) text decoder.

One frozen dataclass shared by the GGUF loader, the test-model generator, the reference
forward and the faster paths. Field names follow the GGUF metadata they come from
(`qwen35.*` keys), not HF's, because the GGUF file is what the engine loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int  # qwen35.embedding_length
    num_layers: int  # decoder layers, excluding the MTP block (block_count - nextn_predict_layers)
    intermediate_size: int  # qwen35.feed_forward_length
    num_attention_heads: int  # qwen35.attention.head_count
    num_kv_heads: int  # qwen35.attention.head_count_kv
    head_dim: int  # qwen35.attention.key_length (== value_length)
    rope_dims: int  # qwen35.rope.dimension_count (partial rotary: first rope_dims of each head)
    rope_theta: float  # qwen35.rope.freq_base
    rms_norm_eps: float  # qwen35.attention.layer_norm_rms_epsilon
    full_attention_interval: int  # qwen35.full_attention_interval
    linear_num_key_heads: int  # qwen35.ssm.group_count
    linear_num_value_heads: int  # qwen35.ssm.time_step_rank
    linear_key_head_dim: int  # qwen35.ssm.state_size
    linear_value_head_dim: int  # qwen35.ssm.inner_size // ssm.time_step_rank
    conv_kernel: int  # qwen35.ssm.conv_kernel
    tied_embeddings: bool  # no output.weight in the file
    context_length: int = 262144
    mtp_layers: int = 0  # qwen35.nextn_predict_layers (MTP block present in the file, unused here)
    rope_sections: tuple[int, ...] = (11, 11, 10, 0)

    def is_full_attention(self, layer: int) -> bool:
        """Every `full_attention_interval`-th layer (3, 7, 11, ... for 4) is gated attention."""
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_full_attention(i)]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_full_attention(i)]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN depthwise conv: q, k and v projections concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def to_dict(self) -> dict:
        return asdict(self)
