"""A forward pass of HF `Qwen3_5ForCausalLM` over a prefix tree of prompts: shared prefixes once.

Why: every question of an event repeats the event's system prompt and evidence (about 73 of a
row's 130 tokens), and its two training rows (the first read-out, the thought) repeat the question
too. A causal model's states after a prefix do not depend on what follows, so the prefix can run
once and its states feed every continuation: the Gated DeltaNet layers pass their recurrent state
and the last `conv_kernel - 1` inputs of their causal convolution, the attention layer its keys and
values (and the continuation's positions start where the prefix ended). The result equals the
plain forward of each full row (tests/pipeline/test_demo_model_train.py holds them together); the
training reads about a third of the tokens.

The computation reuses the HF modules' parameters and HF's own pure-torch gated delta rule
(`torch_chunk_gated_delta_rule`, with its recurrent state passed in and out); only the wiring
between segments is written here. Rows of one stage are right-padded: a padded position has
decay 0 and write strength (beta) 0 in the delta rule, so the state it hands on is the one at the
row's real end; the conv inputs handed on are taken at the real end; padded keys are masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # transformers is imported when a forward runs (it comes with `.[test]`)
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

# The delta rule's chunk length. HF's default (64) pads a 73-token evidence segment to 128 and pays
# a 64x64 triangular solve per chunk; 16 is about twice as fast here for the same result.
CHUNK = 16


@dataclass
class Stage:
    """One depth of the tree: right-padded token ids (compact vocabulary), each row's real length,
    its parent row in the previous stage (`None` for the roots), and its first position."""

    ids: torch.Tensor  # [N, L] long
    lengths: torch.Tensor  # [N] long
    parents: torch.Tensor | None  # [N] long, rows of the previous stage
    starts: torch.Tensor  # [N] long, position of the first token


def _gdn(
    m: hf.Qwen3_5GatedDeltaNet,
    x: torch.Tensor,
    valid: torch.Tensor,
    lengths: torch.Tensor,
    tail: torch.Tensor | None,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Qwen3_5GatedDeltaNet.forward` continued from (conv tail, recurrent state); returns the
    output and the (tail, state) after each row's real end."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    n, length, _ = x.shape
    mixed = m.in_proj_qkv(x).transpose(1, 2)  # [N, C, L]
    z = m.in_proj_z(x).reshape(n, length, -1, m.head_v_dim)
    b = m.in_proj_b(x)
    a = m.in_proj_a(x)
    k = m.conv_kernel_size - 1
    if tail is None:
        tail = mixed.new_zeros(n, mixed.shape[1], k)
    full = torch.cat([tail, mixed], dim=2)
    conv = F.conv1d(full, m.conv1d.weight, m.conv1d.bias, padding=0, groups=mixed.shape[1])
    mixed = F.silu(conv).transpose(1, 2)
    # the last k inputs up to the real end: full[:, :, length_i : length_i + k]
    idx = (lengths[:, None] + torch.arange(k)).unsqueeze(1).expand(-1, full.shape[1], -1)
    new_tail = full.gather(2, idx)
    query, key, value = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    query = query.reshape(n, length, -1, m.head_k_dim)
    key = key.reshape(n, length, -1, m.head_k_dim)
    value = value.reshape(n, length, -1, m.head_v_dim)
    keep = valid[:, :, None].to(x.dtype)
    beta = b.sigmoid() * keep
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias) * keep
    out, new_state = hf.torch_chunk_gated_delta_rule(
        query,
        key,
        value,
        g=g,
        beta=beta,
        chunk_size=CHUNK,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(n, length, -1)
    return m.out_proj(out), new_tail, new_state


def _attention(
    m: hf.Qwen3_5Attention,
    x: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    valid: torch.Tensor,
    past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`Qwen3_5Attention.forward` (eager) after the keys/values of the prefix; returns the output
    and the keys, values and key mask through this segment."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    n, length, _ = x.shape
    shape = (n, length, -1, m.head_dim)
    q, gate = torch.chunk(m.q_proj(x).view(n, length, -1, m.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(n, length, -1)
    q = m.q_norm(q.view(shape)).transpose(1, 2)
    k = m.k_norm(m.k_proj(x).view(shape)).transpose(1, 2)
    v = m.v_proj(x).view(shape).transpose(1, 2)
    cos, sin = cos_sin
    q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None].expand(n, -1, -1)
    if past is not None:
        pk, pv, pmask = past
        k = torch.cat([pk, k], dim=2)
        v = torch.cat([pv, v], dim=2)
        allowed = torch.cat([pmask[:, None, :].expand(-1, length, -1), causal], dim=2)
        keys_valid = torch.cat([pmask, valid], dim=1)
    else:
        allowed = causal
        keys_valid = valid
    mask = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)
    out, _ = hf.eager_attention_forward(m, q, k, v, mask[:, None], scaling=m.scaling)
    out = out.reshape(n, length, -1) * torch.sigmoid(gate)
    return m.o_proj(out), (k, v, keys_valid)


def tree_forward(model: hf.Qwen3_5ForCausalLM, stages: list[Stage]) -> list[torch.Tensor]:
    """Final-norm hidden states [N, L, hidden] of every stage, each row continuing its parent."""
    inner = model.model
    states: list[object] | None = None
    outputs: list[torch.Tensor] = []
    for stage in stages:
        n, length = stage.ids.shape
        valid = torch.arange(length)[None, :] < stage.lengths[:, None]
        x = inner.embed_tokens(stage.ids)
        positions = stage.starts[:, None] + torch.arange(length)[None, :]
        cos_sin = inner.rotary_emb(x, positions)
        new_states: list[object] = []
        for i, layer in enumerate(inner.layers):
            past = None
            if states is not None and stage.parents is not None:
                past = tuple(t[stage.parents] for t in states[i])  # type: ignore[attr-defined]
            h = layer.input_layernorm(x)
            if layer.block_type == "linear_attention":
                tail, state = past if past is not None else (None, None)
                h, tail, state = _gdn(layer.linear_attn, h, valid, stage.lengths, tail, state)
                new_states.append((tail, state))
            else:
                h, kv = _attention(layer.self_attn, h, cos_sin, valid, past)  # type: ignore[arg-type]
                new_states.append(kv)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        states = new_states
        outputs.append(inner.norm(x))
    return outputs
