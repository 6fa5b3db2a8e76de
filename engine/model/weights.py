"""The engine's canonical weight layout, shared by every forward path.

Canonical means "the converter's transforms undone" so that the maths reads like HF's
`modeling_qwen3_5.py`, while keeping the multiplicative form that costs nothing at run time:

- tensors are torch `[out, in]` (GGUF `ne` reversed), keyed per layer by the GGUF tensor
  name without the `blk.N.` prefix and without `.weight`/`.bias` (`attn_q`, `ssm_dt`, ...);
- norm weights are multiplicative, exactly as stored in the GGUF (HF's zero-centred `w`
  is `norm - 1`; `ssm_norm` has no offset in either);
- `ssm_a` is the negative decay rate `-exp(A_log)` as stored;
- `ssm_conv1d` is `[conv_dim, conv_kernel]`, taps ordered oldest to newest;
- linear-attention value heads are in HF's *grouped* order: value head `j` reads key head
  `j // (num_v_heads // num_k_heads)`. The GGUF stores them tiled (value head `j` reads key
  head `j % num_k_heads`); the loader undoes that permutation on every V-indexed axis.
- `attn_q` keeps the per-head `[q | gate]` interleave (rows `2*head_dim*h ... +head_dim` are
  the query of head h, the next `head_dim` rows its output gate).

Per-layer keys:
    all layers:      attn_norm, post_attention_norm, ffn_gate, ffn_up, ffn_down
    full attention:  attn_q, attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm
    linear attention: attn_qkv, attn_gate, ssm_beta, ssm_alpha, ssm_conv1d, ssm_dt, ssm_a,
                      ssm_norm, ssm_out
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.config import ModelConfig

FULL_ATTENTION_KEYS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
LINEAR_ATTENTION_KEYS = (
    "attn_qkv",
    "attn_gate",
    "ssm_beta",
    "ssm_alpha",
    "ssm_conv1d",
    "ssm_dt",
    "ssm_a",
    "ssm_norm",
    "ssm_out",
)
COMMON_LAYER_KEYS = ("attn_norm", "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass
class Weights:
    config: ModelConfig
    token_embd: torch.Tensor  # [vocab, hidden]
    output_norm: torch.Tensor  # [hidden]
    output: torch.Tensor  # [vocab, hidden]; the same tensor as token_embd when tied
    layers: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def layer_keys(self, layer: int) -> tuple[str, ...]:
        mixer = FULL_ATTENTION_KEYS if self.config.is_full_attention(layer) else LINEAR_ATTENTION_KEYS
        return COMMON_LAYER_KEYS + mixer


def v_head_tiled_to_grouped(num_k_heads: int, num_v_heads: int) -> torch.Tensor:
    """Index `perm` such that `grouped[j] = tiled[perm[j]]` for value heads.

    Tiled (GGUF) position `p = r_idx * num_k + k` holds grouped (HF) head `k * ratio + r_idx`.
    """
    ratio = num_v_heads // num_k_heads
    grouped = torch.arange(num_v_heads)
    k, r_idx = grouped // ratio, grouped % ratio
    return r_idx * num_k_heads + k
