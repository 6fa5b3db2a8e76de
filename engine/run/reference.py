"""Readable reference forward of the qwen35 text decoder over canonical `Weights`.

Plain torch on CPU, one sequence at a time, written to be read next to HF's
`modeling_qwen3_5.py`: this is the oracle every faster path is tested against, so clarity
beats speed. Matmuls run in `dtype` (fp32 by default, fp64 for a tighter oracle); norms,
softmax, RoPE angles and the delta-rule recurrence never run below fp32.

Stateful form: `forward_segment` consumes a segment of tokens starting from a `LayerStates`
(the GDN recurrent states and conv tails plus attention K/V of everything before it) and
returns the state after it, so prefix-then-suffix equals the whole sequence.

Kept independent of the faster paths on purpose (issue #26): the one-pass body and the decoder
share one int8 layer stack (`engine.run.layers`) and the level executor has its own, and an
oracle built from either would check that code against itself. Only the kernels' torch fallbacks
and the executor borrow its pieces (norms, RoPE, the delta rule), so they are held to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig
from engine.model.weights import Weights

L2NORM_EPS = 1e-6  # FLA / HF l2norm epsilon for GDN q and k, not the model's rms eps


@dataclass
class LayerStates:
    """Everything a later segment needs from the tokens before it.

    recurrent[i]: GDN layer i's delta-rule state S, [num_v_heads, k_head_dim, v_head_dim]
                  (value heads in grouped order; at least fp32).
    conv[i]:      GDN layer i's last `conv_kernel - 1` pre-conv qkv vectors, [conv_dim, K-1],
                  oldest to newest (zeros before the sequence start).
    keys[i]:      attention layer i's keys after k_norm and RoPE, [num_kv_heads, length, head_dim].
    values[i]:    attention layer i's values, [num_kv_heads, length, head_dim].
    length:       tokens consumed so far, i.e. the absolute position of the next token.
    """

    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    length: int = 0

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype = torch.float32) -> LayerStates:
        """State at sequence start: zero S and conv tails, no K/V."""
        state_dtype = _acc_dtype(dtype)
        c = config
        states = cls()
        for i in c.linear_attention_layers:
            states.recurrent[i] = torch.zeros(
                c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim, dtype=state_dtype
            )
            states.conv[i] = torch.zeros(c.conv_dim, c.conv_kernel - 1, dtype=dtype)
        for i in c.full_attention_layers:
            states.keys[i] = torch.zeros(c.num_kv_heads, 0, c.head_dim, dtype=dtype)
            states.values[i] = torch.zeros(c.num_kv_heads, 0, c.head_dim, dtype=dtype)
        return states


def forward(
    weights: Weights,
    token_ids: Sequence[int] | torch.Tensor,
    *,
    positions: Sequence[int] | torch.Tensor | None = None,
    rows: Sequence[int] | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Logits of a whole sequence from scratch: [T, vocab] (or the selected positions/rows), float32."""
    logits, _ = forward_segment(weights, token_ids, positions=positions, rows=rows, dtype=dtype)
    return logits.float()


def forward_segment(
    weights: Weights,
    token_ids: Sequence[int] | torch.Tensor,
    state: LayerStates | None = None,
    start_pos: int | None = None,
    *,
    output: Literal["logits", "hidden"] = "logits",
    positions: Sequence[int] | torch.Tensor | None = None,
    rows: Sequence[int] | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, LayerStates]:
    """Run one segment from `state` (None: sequence start) and return (result, state after it).

    `start_pos` is the absolute position of the segment's first token; it defaults to
    `state.length` and must agree with it. `positions` (segment-relative indices) selects which
    tokens to read out; `rows` selects vocabulary rows of the LM head (logits only).
    `output="hidden"` returns the final-normed hidden states [len(positions), hidden] instead.
    The input `state` is not modified.
    """
    config = weights.config
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    if output not in ("logits", "hidden"):
        raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
    if output == "hidden" and rows is not None:
        raise ValueError("rows selects LM-head rows and only applies to output='logits'")
    if len(weights.layers) != config.num_layers:
        raise ValueError(f"weights have {len(weights.layers)} layers, config says {config.num_layers}")
    ids = _as_index_tensor(token_ids, "token_ids", config.vocab_size)
    if ids.numel() == 0:
        raise ValueError("token_ids is empty: a segment needs at least one token")
    state = LayerStates.empty(config, dtype) if state is None else state
    _check_state(config, state)
    if start_pos is None:
        start_pos = state.length
    if start_pos != state.length:
        raise ValueError(
            f"start_pos {start_pos} does not match the state, which has consumed {state.length} tokens"
        )
    read = None if positions is None else _as_index_tensor(positions, "positions", ids.numel())

    new_state = LayerStates(length=state.length + ids.numel())
    h = weights.token_embd[ids].to(dtype)
    for i, layer in enumerate(weights.layers):
        x = rms_norm(h, layer["attn_norm"], config.rms_norm_eps)
        if config.is_full_attention(i):
            out, new_state.keys[i], new_state.values[i] = gated_attention(
                config, layer, x, state.keys[i].to(dtype), state.values[i].to(dtype), start_pos
            )
        else:
            out, new_state.recurrent[i], new_state.conv[i] = gated_deltanet(
                config, layer, x, state.recurrent[i], state.conv[i].to(dtype)
            )
        h = h + out
        h = h + mlp(layer, rms_norm(h, layer["post_attention_norm"], config.rms_norm_eps))

    if read is not None:
        h = h[read]
    hidden = rms_norm(h, weights.output_norm, config.rms_norm_eps)
    if output == "hidden":
        return hidden, new_state
    return lm_head(weights, hidden, rows), new_state


def lm_head(
    weights: Weights, hidden: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> torch.Tensor:
    """Logits of final-normed hidden states [N, hidden] -> [N, vocab] or [N, len(rows)]."""
    w = weights.output
    if rows is not None:
        w = w[_as_index_tensor(rows, "rows", weights.config.vocab_size)]
    return hidden @ w.to(hidden.dtype).T


# --- building blocks ---------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last axis, in at least fp32; w is multiplicative."""
    acc = _acc_dtype(x.dtype)
    xf = x.to(acc)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.to(acc)).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.to(x.dtype).T


def mlp(layer: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(x, layer["ffn_gate"])) * linear(x, layer["ffn_up"]), layer["ffn_down"])


def rope_cos_sin(
    config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX (half-split) cos/sin [T, rope_dims] for absolute positions.

    Text-only input gives equal T/H/W position ids, so interleaved MRoPE is plain RoPE.
    Angles are computed in fp64 so the oracle does not inherit fp32 phase error at long positions.
    """
    rd = config.rope_dims
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rope_dims of each head of x [T, heads, head_dim]; the rest pass through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    rot = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
    return torch.cat([rot, rest], dim=-1)


def gated_attention(
    config: ModelConfig,
    layer: dict[str, torch.Tensor],
    x: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    start_pos: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal GQA softmax attention with q/k norm, partial RoPE and a sigmoid output gate.

    Returns (output [T, hidden], keys [n_kv, past+T, hd], values [n_kv, past+T, hd]).
    """
    t = x.shape[0]
    nh, nkv, hd = config.num_attention_heads, config.num_kv_heads, config.head_dim
    # attn_q rows interleave per head: [q_h | gate_h], each head_dim long
    qg = linear(x, layer["attn_q"]).view(t, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(t, nh * hd)
    k = linear(x, layer["attn_k"]).view(t, nkv, hd)
    v = linear(x, layer["attn_v"]).view(t, nkv, hd)
    q = rms_norm(q, layer["attn_q_norm"], config.rms_norm_eps)
    k = rms_norm(k, layer["attn_k_norm"], config.rms_norm_eps)

    pos = torch.arange(start_pos, start_pos + t)
    cos, sin = rope_cos_sin(config, pos, x.dtype)
    q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)

    keys = torch.cat([past_k, k.transpose(0, 1)], dim=1)  # [nkv, S, hd]
    values = torch.cat([past_v, v.transpose(0, 1)], dim=1)
    # query head h reads kv head h // (nh / nkv)
    group = nh // nkv
    k_all = keys.repeat_interleave(group, dim=0)  # [nh, S, hd]
    v_all = values.repeat_interleave(group, dim=0)

    acc = _acc_dtype(x.dtype)
    scores = (q.transpose(0, 1) @ k_all.transpose(1, 2)).to(acc) * hd**-0.5  # [nh, T, S]
    key_pos = torch.arange(keys.shape[1])
    future = key_pos[None, :] > pos[:, None]  # [T, S]
    scores = scores.masked_fill(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(x.dtype)
    attn = (probs @ v_all).transpose(0, 1).reshape(t, nh * hd)
    attn = attn * torch.sigmoid(gate)
    return linear(attn, layer["attn_output"]), keys, values


def fold_attention_piece(
    m: torch.Tensor, total: torch.Tensor, o: torch.Tensor, scores: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one piece of keys into a running softmax: (max, sum, output) after `scores` [..., Tq, L]
    over `values` [..., L, hd]. Pieces folded in a fixed order give the same bits whatever else
    the batch holds (the cascade attention of the forest executor and the decoder's oracle)."""
    m_piece = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m_piece)
    m_new = torch.maximum(m, m_piece)
    old_scale, new_scale = torch.exp(m - m_new), torch.exp(m_piece - m_new)
    total = total * old_scale + p.sum(-1, keepdim=True) * new_scale
    o = o * old_scale + (p @ values) * new_scale
    return m_new, total, o


def causal_conv(
    x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [T, C] continuing from `tail` [C, K-1]; weight [C, K] oldest->newest.

    Returns (conv output [T, C] before activation, new tail [C, K-1]).
    """
    kernel = weight.shape[1]
    full = torch.cat([tail.T, x], dim=0)  # [K-1+T, C]
    windows = full.unfold(0, kernel, 1)  # [T, C, K]; windows[t, c] = full[t : t+K, c]
    out = (windows * weight.to(x.dtype)).sum(-1)
    new_tail = full[full.shape[0] - (kernel - 1) :].T.contiguous()
    return out, new_tail


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule, per value head.

    q, k [T, H, dk] (already normalized and scaled, one per value head); v [T, H, dv];
    g (log-decay, <= 0) and beta [T, H]; state S [H, dk, dv]. For each token:
        S <- exp(g) * S
        S <- S + k (beta * (v - S^T k))^T      (write only what S does not already predict)
        o  = S^T q
    Returns (o [T, H, dv], final S).
    """
    out = torch.empty_like(v)
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", s, k[t])
        delta = beta[t][:, None] * (v[t] - predicted)
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def gated_deltanet(
    config: ModelConfig,
    layer: dict[str, torch.Tensor],
    x: torch.Tensor,
    recurrent: torch.Tensor,
    conv_tail: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated DeltaNet mixer. Returns (output [T, hidden], new recurrent state, new conv tail)."""
    t = x.shape[0]
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim

    qkv, new_tail = causal_conv(linear(x, layer["attn_qkv"]), conv_tail, layer["ssm_conv1d"])
    qkv = F.silu(qkv)
    q, k, v = torch.split(qkv, [nk * dk, nk * dk, nv * dv], dim=-1)

    acc = _acc_dtype(x.dtype)
    q = l2_normalize(q.view(t, nk, dk).to(acc)) * dk**-0.5
    k = l2_normalize(k.view(t, nk, dk).to(acc))
    v = v.view(t, nv, dv).to(acc)
    # grouped value heads: value head j reads key head j // (nv / nk)
    q = q.repeat_interleave(nv // nk, dim=1)
    k = k.repeat_interleave(nv // nk, dim=1)

    beta = torch.sigmoid(linear(x, layer["ssm_beta"]).to(acc))
    alpha = linear(x, layer["ssm_alpha"]).to(acc)
    g = layer["ssm_a"].to(acc) * F.softplus(alpha + layer["ssm_dt"].to(acc))

    o, new_recurrent = gated_delta_rule(q, k, v, g, beta, recurrent.to(acc))

    z = linear(x, layer["attn_gate"]).view(t, nv, dv).to(acc)
    o = rms_norm(o, layer["ssm_norm"], config.rms_norm_eps) * F.silu(z)
    return linear(o.reshape(t, nv * dv).to(x.dtype), layer["ssm_out"]), new_recurrent, new_tail


# --- input checks ------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _as_index_tensor(values: Sequence[int] | torch.Tensor, name: str, bound: int) -> torch.Tensor:
    """1-D int64 tensor with every entry in [0, bound), or a ValueError naming `name`."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.long)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    t = t.long()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= bound):
        bad = t[(t < 0) | (t >= bound)][0].item()
        raise ValueError(f"{name} contains {bad}, outside [0, {bound})")
    return t


def _check_state(config: ModelConfig, state: LayerStates) -> None:
    missing = [i for i in config.linear_attention_layers if i not in state.recurrent or i not in state.conv]
    missing += [i for i in config.full_attention_layers if i not in state.keys or i not in state.values]
    if missing:
        raise ValueError(f"state has no entry for layers {sorted(set(missing))}: not a state of this model")
    for i in config.full_attention_layers:
        if state.keys[i].shape[1] != state.length or state.values[i].shape[1] != state.length:
            raise ValueError(
                f"state of attention layer {i} holds {state.keys[i].shape[1]} keys, "
                f"but its length is {state.length}"
            )
