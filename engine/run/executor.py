"""Executes a packed forest level by level on CPU (and, unchanged, on any torch device).

Token-parallel work (projections, norms, MLP) runs on a level's packed tokens at once. Work
that depends on a segment's history runs per segment from its parent's state: the Gated
DeltaNet conv and recurrence, and attention, which reduces each ancestor's K/V and then the
segment's own, in that fixed order (cascade merge with running max and sum). A segment's
result therefore depends only on its own tokens and its ancestors' states, never on what
else is in the batch.

The last layer computes queries, attention output, MLP and the final norm only at read
positions; the LM head runs only there.

Segment-wise mode (the int8 path, `segmentwise=True`, automatic for int8 weights): every
floating-point op other than the linears also runs per segment, on a fresh contiguous copy
of the segment's rows, so its shapes and memory layout are the same whatever else shares
the level. That matters because torch's elementwise kernels (exp, sigmoid, softplus, silu,
cos...) compute a vectorized body and a scalar tail, and CPU `parallel_for` / GPU reduction
configs split work by the *total* size: in a level-wide tensor the same element can land in
a different code path and come out 1 ulp apart. The int8 linears need no such care: their
integer products are exact and the rest of them is row-local (`engine.quant.linear`).

On CUDA the same torch ops run unchanged (slowly): this executor is the oracle the one-pass
body (`engine.run.body`, the CUDA int8 path) is compared against, not a serving path, and it makes
no batch-invariance promise there (torch picks GPU reduction layouts from the shape).

Linear layers go through `linear()`: a weight is either a float tensor `[out, in]` or an
object with `__call__(x) -> y` (the int8 path's quantized linear).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kernels.gate_up import split_gate_up
from engine.model.config import ModelConfig
from engine.model.weights import Weights
from engine.run import elementwise
from engine.run.forest import Forest, SegmentState
from engine.run.int8_rows import MLP_INPUTS, stored_group
from engine.run.reference import (
    apply_partial_rope,
    causal_conv,
    fold_attention_piece,
    gated_delta_rule,
    l2_normalize,
    rms_norm,
)
from engine.vision.placement import mrope_rows


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


def run_forest(
    weights: Weights,
    forest: Forest,
    *,
    dtype: torch.dtype = torch.float32,
    segmentwise: bool | None = None,
) -> ForestOutput:
    """Run every level of `forest`; `segmentwise` None means: on when the weights are int8."""
    config = weights.config
    if segmentwise is None:
        segmentwise = not isinstance(weights.output, torch.Tensor)
    states: list[SegmentState | None] = [None] * len(forest.segments)
    read_hidden: dict[int, torch.Tensor] = {}
    counters = ForestCounters(read_positions=len(forest.read_segments))
    device = weights.output_norm.device
    for level in range(forest.num_levels):
        segs = forest.level_segments(level)
        _run_level(weights, forest, segs, states, read_hidden, dtype, device, segmentwise)
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
    segmentwise: bool,
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
    imaged = [forest.segments[s].images is not None for s in segs]
    if any(imaged):
        positions = _image_positions(forest, segs, positions, ranges)
    parents = [_parent_state(forest, states, s) for s in segs]
    level_states = [
        SegmentState(parent=p, start=int(forest.starts[s]), length=n, shift=forest.segments[s].shift)
        for s, p, n in zip(segs, parents, lengths, strict=True)
    ]
    # rows (in level-local order) whose output the last layer must produce
    read_local = [hi - 1 for (lo, hi), s in zip(ranges, segs, strict=True) if forest.segments[s].read]

    # Spans the non-linear float ops run over: per segment (segment-wise) or all rows at once.
    spans = ranges if segmentwise else None
    read_spans = [(k, k + 1) for k in range(len(read_local))] if segmentwise else None
    eps = config.rms_norm_eps

    h = weights.token_embd[tokens].to(dtype)
    if any(imaged):
        h = _place_images(forest, segs, ranges, h)
    last = config.num_layers - 1
    for i, layer in enumerate(weights.layers):
        x = _spanwise(rms_norm, spans, h, weight=layer["attn_norm"], eps=eps)
        rows = read_local if i == last else None
        if config.is_full_attention(i):
            out = _attention(config, i, layer, x, positions, ranges, level_states, rows, spans)
        else:
            out = _deltanet(config, i, layer, x, ranges, level_states, spans)
            if rows is not None:
                out = out[rows]
        if rows is not None:
            h = h[rows]
        h = h + out
        mlp_spans = read_spans if rows is not None else spans
        x = _spanwise(rms_norm, mlp_spans, h, weight=layer["post_attention_norm"], eps=eps)
        h = h + _mlp(layer, x, mlp_spans)

    hidden = _spanwise(rms_norm, read_spans, h, weight=weights.output_norm, eps=eps)
    read_segs = [s for s in segs if forest.segments[s].read]
    for row, s in enumerate(read_segs):
        read_hidden[s] = hidden[row]
    for s, st in zip(segs, level_states, strict=True):
        states[s] = st


def _image_positions(
    forest: Forest, segs: list[int], positions: torch.Tensor, ranges: list[tuple[int, int]]
) -> torch.Tensor:
    """[3, N] rope positions (time, height, width) of a level holding images: a text-only
    segment's three axes are its 1-D positions, an image segment's come from its images."""
    out = positions[None, :].repeat(3, 1)
    for s, (lo, hi) in zip(segs, ranges, strict=True):
        images = forest.segments[s].images
        if images is not None:
            out[:, lo:hi] = int(forest.starts[s]) + images.offsets
    return out


def _place_images(
    forest: Forest, segs: list[int], ranges: list[tuple[int, int]], h: torch.Tensor
) -> torch.Tensor:
    """Token embeddings with every image pad row replaced by its image embedding (as HF's
    `masked_scatter` does): the tower's output is the input of the text model there."""
    h = h.clone()
    for s, (lo, _) in zip(segs, ranges, strict=True):
        images = forest.segments[s].images
        if images is not None:
            h[lo + images.index.to(h.device)] = images.embeds.to(h.device, h.dtype)
    return h


def _spanwise(
    fn: Callable[..., torch.Tensor], spans: list[tuple[int, int]] | None, *xs: torch.Tensor, **kw: Any
) -> torch.Tensor:
    """fn over all rows of xs at once (spans None), or over each span's rows on their own.

    Each span gets fresh contiguous copies, so fn sees the same shapes, strides and alignment
    as when that segment is the only one in the batch.
    """
    if spans is None:
        return fn(*xs, **kw)
    if not spans:
        return fn(*(x[:0].contiguous() for x in xs), **kw)
    parts = [
        fn(*(x[lo:hi].clone(memory_format=torch.contiguous_format) for x in xs), **kw) for lo, hi in spans
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return elementwise.silu(gate) * up


def _gate_up(layer: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ffn_gate(x) and ffn_up(x). Where a CUDA body stored them interleaved (`int8_rows.input_group`:
    the layer's entries are then strided row views, which Hopper's CUTLASS GEMM does not take), one
    GEMM over the stored weight and its even and odd columns: the same exact dots and epilogue, so
    the same bits, at the stacked GEMM's speed (the image evidence path runs here on a GPU). The
    columns stay views: `elementwise`'s activations give an element the same bits wherever it sits,
    so no copy is needed (`_spanwise` still copies each span, as for every layer)."""
    group = stored_group(layer, MLP_INPUTS)
    if group is None:
        return linear(x, layer["ffn_gate"]), linear(x, layer["ffn_up"])
    return split_gate_up(linear(x, group.linear))


def _mlp(layer: dict, x: torch.Tensor, spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
    hidden = _spanwise(_swiglu, spans, *_gate_up(layer, x))
    return linear(hidden, layer["ffn_down"])


def _beta(b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    return elementwise.sigmoid(b.to(acc))


def _decay(a: torch.Tensor, ssm_a: torch.Tensor, dt: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    return ssm_a.to(acc) * elementwise.softplus(a.to(acc) + dt.to(acc))


def _gated_norm(
    o: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    shape: tuple[int, int],
    acc: torch.dtype,
) -> torch.Tensor:
    return rms_norm(o, weight, eps) * elementwise.silu(z.view(-1, *shape).to(acc))


def _sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return o * elementwise.sigmoid(gate)


def _deltanet(
    config: ModelConfig,
    i: int,
    layer: dict,
    x: torch.Tensor,
    ranges: list[tuple[int, int]],
    level_states: list[SegmentState],
    spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    acc = torch.promote_types(x.dtype, torch.float32)
    qkv_all = linear(x, layer["attn_qkv"])
    beta_all = _spanwise(_beta, spans, linear(x, layer["ssm_beta"]), acc=acc)
    g_all = _spanwise(
        _decay, spans, linear(x, layer["ssm_alpha"]), ssm_a=layer["ssm_a"], dt=layer["ssm_dt"], acc=acc
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
        q, k, v = torch.split(elementwise.silu(conv), [nk * dk, nk * dk, nv * dv], dim=-1)
        t = hi - lo
        q = (l2_normalize(q.view(t, nk, dk).to(acc)) * dk**-0.5).repeat_interleave(nv // nk, dim=1)
        k = l2_normalize(k.view(t, nk, dk).to(acc)).repeat_interleave(nv // nk, dim=1)
        o_all[lo:hi], st.recurrent[i] = gated_delta_rule(
            q, k, v.view(t, nv, dv).to(acc), g_all[lo:hi], beta_all[lo:hi], s0
        )
    z = linear(x, layer["attn_gate"])
    o = _spanwise(
        _gated_norm,
        spans,
        o_all,
        z,
        weight=layer["ssm_norm"],
        eps=config.rms_norm_eps,
        shape=(nv, dv),
        acc=acc,
    )
    return linear(o.reshape(-1, nv * dv).to(x.dtype), layer["ssm_out"])


def _attention(
    config: ModelConfig,
    i: int,
    layer: dict,
    x: torch.Tensor,
    positions: torch.Tensor,  # [N], or [3, N] (time, height, width) when the level holds images
    ranges: list[tuple[int, int]],
    level_states: list[SegmentState],
    rows: list[int] | None,
    spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Gated attention over ancestors' K/V and the own segment; output rows = `rows` or all."""
    nh, nkv, hd = config.num_attention_heads, config.num_kv_heads, config.head_dim
    eps = config.rms_norm_eps
    q_rows = torch.arange(x.shape[0]) if rows is None else torch.tensor(rows, dtype=torch.long)
    row_list = q_rows.tolist()
    k_raw = linear(x, layer["attn_k"]).view(-1, nkv, hd)
    v = linear(x, layer["attn_v"]).view(-1, nkv, hd)
    xq = x[q_rows]
    qg = linear(xq, layer["attn_q"]).view(-1, nh, 2 * hd)
    q_spans: list[tuple[int, int]] | None = None
    if spans is None:
        cos, sin = mrope_rows(config, positions, x.dtype)
        cos, sin = cos.to(x.device), sin.to(x.device)
        k = apply_partial_rope(rms_norm(k_raw, layer["attn_k_norm"], eps), cos, sin)
        q = rms_norm(qg[..., :hd], layer["attn_q_norm"], eps)
        q = apply_partial_rope(q, cos[q_rows], sin[q_rows])
    else:
        # Per segment: RoPE angles, norms and rotations see only the segment's own rows.
        k_parts, q_parts, q_spans = [], [], []
        for lo, hi in spans:
            cos, sin = mrope_rows(config, positions[..., lo:hi], x.dtype)
            cos, sin = cos.to(x.device), sin.to(x.device)
            k_seg = rms_norm(_own(k_raw[lo:hi]), layer["attn_k_norm"], eps)
            k_parts.append(apply_partial_rope(k_seg, cos, sin))
            sel = [j for j, r in enumerate(row_list) if lo <= r < hi]  # a contiguous block of q rows
            if not sel:
                continue
            local = torch.tensor([row_list[j] - lo for j in sel], dtype=torch.long)
            q_seg = rms_norm(_own(qg[sel[0] : sel[-1] + 1, :, :hd]), layer["attn_q_norm"], eps)
            q_parts.append(apply_partial_rope(q_seg, cos[local], sin[local]))
            q_spans.append((sel[0], sel[-1] + 1))
        k = torch.cat(k_parts)
        q = torch.cat(q_parts) if q_parts else qg[:0, :, :hd].contiguous()
    for (lo, hi), st in zip(ranges, level_states, strict=True):
        st.keys[i] = k[lo:hi].transpose(0, 1).contiguous()
        st.values[i] = v[lo:hi].transpose(0, 1).contiguous()
    gate = qg[..., hd:].reshape(-1, nh * hd)

    out = torch.empty(len(q_rows), nh * hd, dtype=x.dtype, device=x.device)
    for (lo, hi), st in zip(ranges, level_states, strict=True):
        sel = [j for j, r in enumerate(row_list) if lo <= r < hi]
        if not sel:
            continue
        local = torch.tensor([row_list[j] - lo for j in sel], dtype=torch.long)
        out[sel] = _cascade(q[sel], local, st, i, nh // nkv)
    out = _spanwise(_sigmoid_gate, q_spans, out, gate)
    return linear(out, layer["attn_output"])


def _own(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy: the layout a segment's rows have when nothing else is in the batch."""
    return t.clone(memory_format=torch.contiguous_format)


def _cascade(q: torch.Tensor, local_pos: torch.Tensor, st: SegmentState, i: int, group: int) -> torch.Tensor:
    """Softmax attention of queries q [Tq, nh, hd] over the chain's K/V, merged in chain order.

    Each K/V head's query group is reduced on its own (so the shapes, and the bits, do not
    depend on how many heads this device holds: see `engine.run.tp`). Within a group each piece
    (an ancestor's K/V, then the segment's own, causal at `local_pos`) is reduced on its own,
    then folded into a running (max, sum, output) - so the result never depends on how many
    other segments share the batch.
    """
    tq, nh, hd = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    qh = q.transpose(0, 1).to(acc)  # [nh, Tq, hd]
    chain = st.chain()
    future = None
    outs = []
    for g in range(nh // group):
        qg = qh[g * group : (g + 1) * group]
        m = torch.full((group, tq, 1), float("-inf"), dtype=acc, device=q.device)
        total = torch.zeros(group, tq, 1, dtype=acc, device=q.device)
        o = torch.zeros(group, tq, hd, dtype=acc, device=q.device)
        for node in chain:
            keys = node.keys[i][g : g + 1].to(acc)  # [1, L, hd], shared by the group's query heads
            values = node.values[i][g : g + 1].to(acc)
            scores = (qg @ keys.transpose(1, 2)) * hd**-0.5  # [group, Tq, L]
            if node is st:
                if future is None:
                    key_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
                    future = key_pos > local_pos[:, None].to(q.device)
                scores = scores.masked_fill(future, float("-inf"))
            m, total, o = fold_attention_piece(m, total, o, scores, values)
        outs.append(o / total)
    return torch.cat(outs).transpose(0, 1).reshape(tq, nh * hd).to(q.dtype)
