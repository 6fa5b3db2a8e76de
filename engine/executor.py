"""Executes a packed forest level by level on CPU (and, unchanged, on any torch device).

Token-parallel work (projections, norms, MLP) runs on a level's packed tokens at once. Work
that depends on a segment's history runs per segment from its parent's state: the Gated
DeltaNet conv and recurrence, and attention, which reduces each ancestor's K/V and then the
segment's own, in that fixed order (cascade merge with running max and sum). A segment's
result therefore depends only on its own tokens and its ancestors' states, never on what
else is in the batch.

The last layer computes queries, attention output, MLP and the final norm only at read
positions; the LM head runs only there.

Linear layers go through `linear()`: a weight is either a float tensor `[out, in]` or an
object with `__call__(x) -> y` (the int8 path's quantized linear).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.forest import Forest, SegmentState
from engine.reference import (
    apply_partial_rope,
    causal_conv,
    gated_delta_rule,
    l2_normalize,
    rms_norm,
    rope_cos_sin,
)
from engine.weights import Weights


@dataclass
class ForestCounters:
    """What a forest run computed: tests and benchmarks use it to show evidence ran once."""

    tokens_per_level: list[int] = field(default_factory=list)
    segments_per_level: list[int] = field(default_factory=list)
    read_positions: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.tokens_per_level)


@dataclass
class ForestOutput:
    logits: torch.Tensor  # [R, vocab] float32 at the read positions, in Forest.read_segments order
    states: list[SegmentState]  # one per forest segment, in packed order
    counters: ForestCounters


def linear(x: torch.Tensor, weight: object) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return x @ weight.to(x.dtype).T
    return weight(x)  # type: ignore[operator]


def run_forest(weights: Weights, forest: Forest, *, dtype: torch.dtype = torch.float32) -> ForestOutput:
    config = weights.config
    states: list[SegmentState | None] = [None] * len(forest.segments)
    read_hidden: dict[int, torch.Tensor] = {}
    counters = ForestCounters(read_positions=len(forest.read_segments))
    device = weights.output_norm.device
    for level in range(forest.num_levels):
        segs = forest.level_segments(level)
        _run_level(weights, forest, segs, states, read_hidden, dtype, device)
        counters.tokens_per_level.append(sum(len(forest.segments[s].tokens) for s in segs))
        counters.segments_per_level.append(len(segs))
    if forest.read_segments:
        hidden = torch.stack([read_hidden[s] for s in forest.read_segments])
        logits = linear(hidden, weights.output).float()
    else:
        logits = torch.zeros(0, config.vocab_size)
    return ForestOutput(logits=logits, states=states, counters=counters)  # type: ignore[arg-type]


def _parent_state(forest: Forest, states: list[SegmentState | None], s: int) -> SegmentState | None:
    p = int(forest.parents[s])
    if p >= 0:
        return states[p]
    parent = forest.segments[s].parent
    return parent if isinstance(parent, SegmentState) else None


def _run_level(
    weights: Weights,
    forest: Forest,
    segs: list[int],
    states: list[SegmentState | None],
    read_hidden: dict[int, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    config = weights.config
    lengths = [len(forest.segments[s].tokens) for s in segs]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
    tokens = torch.cat([forest.tokens[forest.offsets[s] : forest.offsets[s + 1]] for s in segs]).to(device)
    positions = torch.cat(
        [
            torch.arange(int(forest.starts[s]), int(forest.starts[s]) + n)
            for s, n in zip(segs, lengths, strict=True)
        ]
    )
    parents = [_parent_state(forest, states, s) for s in segs]
    level_states = [
        SegmentState(parent=p, start=int(forest.starts[s]), length=n)
        for s, p, n in zip(segs, parents, lengths, strict=True)
    ]
    # rows (in level-local order) whose output the last layer must produce
    read_local = [hi - 1 for (lo, hi), s in zip(ranges, segs, strict=True) if forest.segments[s].read]

    h = weights.token_embd[tokens].to(dtype)
    last = config.num_layers - 1
    for i, layer in enumerate(weights.layers):
        x = rms_norm(h, layer["attn_norm"], config.rms_norm_eps)
        rows = read_local if i == last else None
        if config.is_full_attention(i):
            out = _attention(config, i, layer, x, positions, ranges, level_states, rows)
        else:
            out = _deltanet(config, i, layer, x, ranges, level_states)
            if rows is not None:
                out = out[rows]
        if rows is not None:
            h = h[rows]
        h = h + out
        h = h + _mlp(layer, rms_norm(h, layer["post_attention_norm"], config.rms_norm_eps))

    hidden = rms_norm(h, weights.output_norm, config.rms_norm_eps)
    read_segs = [s for s in segs if forest.segments[s].read]
    for row, s in enumerate(read_segs):
        read_hidden[s] = hidden[row]
    for s, st in zip(segs, level_states, strict=True):
        states[s] = st


def _mlp(layer: dict, x: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(x, layer["ffn_gate"])) * linear(x, layer["ffn_up"]), layer["ffn_down"])


def _deltanet(
    config: ModelConfig,
    i: int,
    layer: dict,
    x: torch.Tensor,
    ranges: list[tuple[int, int]],
    level_states: list[SegmentState],
) -> torch.Tensor:
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    acc = torch.promote_types(x.dtype, torch.float32)
    qkv_all = linear(x, layer["attn_qkv"])
    beta_all = torch.sigmoid(linear(x, layer["ssm_beta"]).to(acc))
    g_all = layer["ssm_a"].to(acc) * F.softplus(
        linear(x, layer["ssm_alpha"]).to(acc) + layer["ssm_dt"].to(acc)
    )
    o_all = torch.empty(x.shape[0], nv, dv, dtype=acc, device=x.device)
    for (lo, hi), st in zip(ranges, level_states, strict=True):
        parent = st.parent
        if parent is None:
            tail = torch.zeros(config.conv_dim, config.conv_kernel - 1, dtype=x.dtype, device=x.device)
            s0 = torch.zeros(nv, dk, dv, dtype=acc, device=x.device)
        else:
            tail, s0 = parent.conv[i].to(x.dtype), parent.recurrent[i]
        conv, st.conv[i] = causal_conv(qkv_all[lo:hi], tail, layer["ssm_conv1d"])
        q, k, v = torch.split(F.silu(conv), [nk * dk, nk * dk, nv * dv], dim=-1)
        t = hi - lo
        q = (l2_normalize(q.view(t, nk, dk).to(acc)) * dk**-0.5).repeat_interleave(nv // nk, dim=1)
        k = l2_normalize(k.view(t, nk, dk).to(acc)).repeat_interleave(nv // nk, dim=1)
        o_all[lo:hi], st.recurrent[i] = gated_delta_rule(
            q, k, v.view(t, nv, dv).to(acc), g_all[lo:hi], beta_all[lo:hi], s0
        )
    z = linear(x, layer["attn_gate"]).view(-1, nv, dv).to(acc)
    o = rms_norm(o_all, layer["ssm_norm"], config.rms_norm_eps) * F.silu(z)
    return linear(o.reshape(-1, nv * dv).to(x.dtype), layer["ssm_out"])


def _attention(
    config: ModelConfig,
    i: int,
    layer: dict,
    x: torch.Tensor,
    positions: torch.Tensor,
    ranges: list[tuple[int, int]],
    level_states: list[SegmentState],
    rows: list[int] | None,
) -> torch.Tensor:
    """Gated attention over ancestors' K/V and the own segment; output rows = `rows` or all."""
    nh, nkv, hd = config.num_attention_heads, config.num_kv_heads, config.head_dim
    cos, sin = rope_cos_sin(config, positions, x.dtype)
    cos, sin = cos.to(x.device), sin.to(x.device)
    k = rms_norm(linear(x, layer["attn_k"]).view(-1, nkv, hd), layer["attn_k_norm"], config.rms_norm_eps)
    k = apply_partial_rope(k, cos, sin)
    v = linear(x, layer["attn_v"]).view(-1, nkv, hd)
    for (lo, hi), st in zip(ranges, level_states, strict=True):
        st.keys[i] = k[lo:hi].transpose(0, 1).contiguous()
        st.values[i] = v[lo:hi].transpose(0, 1).contiguous()

    q_rows = torch.arange(x.shape[0]) if rows is None else torch.tensor(rows, dtype=torch.long)
    xq = x[q_rows]
    qg = linear(xq, layer["attn_q"]).view(-1, nh, 2 * hd)
    q = rms_norm(qg[..., :hd], layer["attn_q_norm"], config.rms_norm_eps)
    q = apply_partial_rope(q, cos[q_rows], sin[q_rows])
    gate = qg[..., hd:].reshape(-1, nh * hd)

    out = torch.empty(len(q_rows), nh * hd, dtype=x.dtype, device=x.device)
    row_list = q_rows.tolist()
    for (lo, hi), st in zip(ranges, level_states, strict=True):
        sel = [j for j, r in enumerate(row_list) if lo <= r < hi]
        if not sel:
            continue
        local = torch.tensor([row_list[j] - lo for j in sel], dtype=torch.long)
        out[sel] = _cascade(q[sel], local, st, i, nh // nkv)
    out = out * torch.sigmoid(gate)
    return linear(out, layer["attn_output"])


def _cascade(q: torch.Tensor, local_pos: torch.Tensor, st: SegmentState, i: int, group: int) -> torch.Tensor:
    """Softmax attention of queries q [Tq, nh, hd] over the chain's K/V, merged in chain order.

    Each piece (an ancestor's K/V, then the segment's own, causal at `local_pos`) is reduced
    on its own, then folded into a running (max, sum, output) - so the result never depends
    on how many other segments share the batch.
    """
    tq, nh, hd = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    qh = q.transpose(0, 1).to(acc)  # [nh, Tq, hd]
    m = torch.full((nh, tq, 1), float("-inf"), dtype=acc, device=q.device)
    total = torch.zeros(nh, tq, 1, dtype=acc, device=q.device)
    o = torch.zeros(nh, tq, hd, dtype=acc, device=q.device)
    chain = st.chain()
    for node in chain:
        keys = node.keys[i].repeat_interleave(group, dim=0).to(acc)  # [nh, L, hd]
        values = node.values[i].repeat_interleave(group, dim=0).to(acc)
        scores = (qh @ keys.transpose(1, 2)) * hd**-0.5  # [nh, Tq, L]
        if node is st:
            future = torch.arange(keys.shape[1], device=q.device)[None, :] > local_pos[:, None].to(q.device)
            scores = scores.masked_fill(future, float("-inf"))
        m_piece = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - m_piece)
        m_new = torch.maximum(m, m_piece)
        old_scale, new_scale = torch.exp(m - m_new), torch.exp(m_piece - m_new)
        total = total * old_scale + p.sum(-1, keepdim=True) * new_scale
        o = o * old_scale + (p @ values) * new_scale
        m = m_new
    return (o / total).transpose(0, 1).reshape(tq, nh * hd).to(q.dtype)
