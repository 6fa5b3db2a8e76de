"""The int8 layer stack written once for the graph-captured passes (`engine.run.body`, `.decoder`).

Embedding, then per layer: RMSNorm and the grouped int8 projections, the token mixer (gated
DeltaNet or full attention), the output projection and residual, the SwiGLU MLP and residual;
the final norm and the LM head at the rows read. The two passes differ only in how a mixer reads
and writes its state - the forest kernels over device tables of segments (`ForestBody`), the
one-token kernels over per-sequence rows (`Decoder`) - which is what a subclass supplies
(`_gdn`, `_attend`). A pass that reads a few rows of many (the forest body: one per question)
can run its last layer for the read rows only (`reads_only_last`, `_last_layer_at_reads`):
every row's state, the rest at the reads (`_attend_reads` for an attention layer). The level
executor (`engine.run.executor`) and the CPU oracle (`engine.run.reference`) stay separate on
purpose: they are the float paths these kernels are tested against, and an oracle sharing this
code would check it against itself.

May import: `engine.run.int8_rows`, `engine.model`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from engine.kernels.decode_attention import AttentionHeads
from engine.model.config import ModelConfig
from engine.model.weights import Weights
from engine.quant.linear import QuantLinear
from engine.run.graphs import BucketGraphs
from engine.run.int8_rows import (
    attention_output_residual,
    gdn_output_residual,
    group_inputs,
    grouped_projections,
    lm_head,
    mlp_residual,
    split_projections,
)

GDN_INPUTS = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")
ATTENTION_INPUTS = ("attn_q", "attn_k", "attn_v")


class GdnInputs(NamedTuple):
    """A DeltaNet layer's projected rows: the conv's input and the raw beta and decay gates."""

    qkv: torch.Tensor
    b_raw: torch.Tensor
    a_raw: torch.Tensor


class AttentionInputs(NamedTuple):
    """A full-attention layer's projected rows: the query with its gate, the key and the value."""

    qg: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class Int8Layers:
    """The layer stack over `weights` (int8 linears); subclasses run the mixers' kernels."""

    weights: Weights
    config: ModelConfig

    def _bind(self, weights: Weights, graphs: bool | None, name: str) -> None:
        """Take int8 `weights` on their device (`name` the pass, for the error), with CUDA graphs
        per bucket when `graphs` (None: on CUDA), and group the projections that share an input."""
        if not isinstance(weights.output, QuantLinear):
            raise ValueError(f"the {name} runs the int8 path: weights must hold QuantLinear linears")
        self.weights = weights
        self.config = weights.config
        self.device = weights.output_norm.device
        self._graphs = BucketGraphs(self.device, graphs)  # raises for graphs without CUDA
        self.graphs = self._graphs.enabled
        group_inputs(weights.layers)  # one GEMM per shared input; before any capture
        self._index_layers()

    def _index_layers(self) -> None:
        """Which layers mix how, and the sizes and head keywords both passes' kernels take."""
        c = self.config
        self.gdn_layers = c.linear_attention_layers
        self.attn_layers = c.full_attention_layers
        self._gdn_index = {layer: j for j, layer in enumerate(self.gdn_layers)}
        self._attn_index = {layer: j for j, layer in enumerate(self.attn_layers)}
        nv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        self.state_size = nv * dk * dv  # one DeltaNet layer's recurrent state, per sequence
        self.tail_size = c.conv_dim * (c.conv_kernel - 1)  # one layer's conv tail, per sequence
        self.gdn_heads = dict(num_k_heads=c.linear_num_key_heads, num_v_heads=nv, k_dim=dk, v_dim=dv)
        heads = (c.num_attention_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
        self.attention_heads = AttentionHeads(*heads)

    # Whether `_stack` with read rows runs the last layer for them only (`_last_layer_at_reads`);
    # False: every layer on every row, then the read rows picked (the former pass).
    reads_only_last: bool = False

    def _stack(self, tokens: torch.Tensor, bucket: Any, reads: torch.Tensor | None = None) -> torch.Tensor:
        """Embedding -> layers -> final norm -> LM head (at `reads`, else every row): fp32 logits."""
        w, c = self.weights, self.config
        eps = c.rms_norm_eps
        h = w.token_embd.index_select(0, tokens).float()
        last = len(w.layers) - 1
        for i, layer in enumerate(w.layers):
            if reads is not None and i == last and self.reads_only_last:
                h = self._last_layer_at_reads(i, layer, h, bucket, reads)
                return lm_head(h, w.output_norm, w.output, eps)
            if c.is_full_attention(i):
                h = self._attention(i, layer, h, bucket)
            else:
                h = self._deltanet(i, layer, h, bucket)
            h = mlp_residual(h, layer, eps)
        if reads is not None:
            h = h.index_select(0, reads)
        return lm_head(h, w.output_norm, w.output, eps)

    def _last_layer_at_reads(
        self, i: int, layer: dict, h: torch.Tensor, bucket: Any, reads: torch.Tensor
    ) -> torch.Tensor:
        """The last layer (i) computing only what the read-outs and the states need: hidden rows
        [R, hidden] at `reads`.

        After the last layer's token mixer nothing reads a row but the LM head, so the output
        projection, the residual and the MLP run on the read rows alone. The mixer's state is
        every row's: a full-attention layer projects every row's key and value (the segments'
        K/V: prefix cache, children, thought decoder) but only the read rows' query and gate
        (`_attend_reads`); a DeltaNet layer runs its conv and recurrence on every row (the final
        states) and projects the output gate z at the read rows only. Every op is row-local, so
        a read row's bits are those of the full layer given the same mixer output; the states'
        bits are the full layer's (`split_projections`)."""
        eps = self.config.rms_norm_eps
        norm = layer["attn_norm"]
        if self.config.is_full_attention(i):
            qg, k, v = split_projections(h, norm, eps, layer, ATTENTION_INPUTS, reads, frozenset({"attn_q"}))
            out = self._attend_reads(
                bucket.pieces[self._attn_index[i]], layer, AttentionInputs(qg, k, v), bucket
            )
            h = attention_output_residual(out, layer, h.index_select(0, reads))
        else:
            qkv, z, b_raw, a_raw = split_projections(
                h, norm, eps, layer, GDN_INPUTS, reads, frozenset({"attn_gate"})
            )
            o = self._gdn(self._gdn_index[i], layer, GdnInputs(qkv, b_raw, a_raw), bucket)
            h = gdn_output_residual(o.index_select(0, reads), z, layer, eps, h.index_select(0, reads))
        return mlp_residual(h, layer, eps)

    def _deltanet(self, i: int, layer: dict, h: torch.Tensor, bucket: Any) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        qkv, z, b_raw, a_raw = grouped_projections(h, layer["attn_norm"], eps, layer, GDN_INPUTS)
        o = self._gdn(self._gdn_index[i], layer, GdnInputs(qkv, b_raw, a_raw), bucket)
        return gdn_output_residual(o, z, layer, eps, h)

    def _attention(self, i: int, layer: dict, h: torch.Tensor, bucket: Any) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        x = AttentionInputs(*grouped_projections(h, layer["attn_norm"], eps, layer, ATTENTION_INPUTS))
        out = self._attend(bucket.pieces[self._attn_index[i]], layer, x, bucket)
        return attention_output_residual(out, layer, h)

    def _gdn(self, j: int, layer: dict, x: GdnInputs, bucket: Any) -> torch.Tensor:
        """The j-th DeltaNet layer's conv and recurrence: outputs [rows, value heads, value dim]."""
        raise NotImplementedError

    def _attend(self, pieces: torch.Tensor, layer: dict, x: AttentionInputs, bucket: Any) -> torch.Tensor:
        """A full-attention layer's norms, RoPE, cache writes and attention: [rows, heads * dim]."""
        raise NotImplementedError

    def _attend_reads(
        self, pieces: torch.Tensor, layer: dict, x: AttentionInputs, bucket: Any
    ) -> torch.Tensor:
        """`_attend` for a last layer whose queries are wanted at the read rows only: x.qg holds
        the read rows' [q | gate] ([R, ...]), x.k and x.v every row's; every row's key and value
        are stored as `_attend` stores them; returns the read rows' outputs [R, heads * dim]."""
        raise NotImplementedError
