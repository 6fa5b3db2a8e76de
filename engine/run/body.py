"""The whole forest in one pass over the layers, on device tables; one CUDA graph per bucket.

`engine.run.executor.run_forest` runs a forest level by level: every level reads every weight
again and launches thousands of small kernels from Python. `ForestBody` runs the int8 path's
forest in one sweep instead:

- Rows are all T packed tokens of every level. The linears (and the norms and quantizers
  around them) run on all rows at once, so each weight is read once per pass.
- Only what carries state from a segment to its children is ordered by level: the Gated
  DeltaNet recurrence runs one launch per level (a child starts from the final state its
  parent's launch just wrote, `engine.kernels.forest_gdn`). The conv needs no ordering (a
  child's first inputs are its parent's last rows of the same pass) and neither does attention:
  every segment's K/V is written before any query reads, and a query walks its chain's K/V
  blocks in place (`engine.kernels.forest_attention`), ancestors oldest first, then its own.
- The forest's shape lives in device tables (`engine.kernels.forest_tables`): a bucket
  (T rows, S segment slots, P pieces, levels) has fixed table shapes, so on CUDA the pass is
  captured once per bucket as a `torch.cuda.CUDAGraph` and replayed for any forest that fits;
  padding rows and slots read and write nothing that matters.

- The last layer computes only what the read-outs and the states need (`last_layer="reads"`):
  every row's K/V (or DeltaNet recurrence), the query, attention, output projection and MLP at
  the read rows only; a read row is attended by the decode kernel over its segment's pieces
  (`_read_tables`: fixed shapes per bucket, uploaded with the other tables). At 8,192 rows and
  one read that is ~1/64 of the pass's GEMMs and the whole last layer's attention but one row.

Each segment's outputs (its K/V per attention layer, final recurrent state and conv tail per
GDN layer) go to one fp32 block of its own, allocated per call, whose views become the
segment's `SegmentState`: the prefix cache and the thought decoder use them as they are.

Every float op of a row runs in programs that see only that row or that segment, with configs
fixed by the model's sizes, so a segment's bits do not depend on the bucket, its slot, or what
else shares the pass; a parent from the prefix cache gives the same bits as the same parent
computed in the pass (its blocks hold the very values the pass would read).
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import structlog
import torch

from engine.kernels import forest_attention as forest_attention_module
from engine.kernels.attached import attach
from engine.kernels.decode_attention import PrepInputs, decode_attention
from engine.kernels.decode_rows import LIVE, PIECE_FIELDS, THOUGHT_LEN, element_offset
from engine.kernels.decode_rows import ROW_FIELDS as DECODE_ROW_FIELDS
from engine.kernels.forest_attention import (
    ATTENTION_DOTS,
    attention_warps,
    forest_attention,
    forest_attention_prep,
)
from engine.kernels.forest_gdn import (
    TC_PREP_FORMS,
    forest_conv,
    forest_gdn,
    forest_gdn_outputs,
    forest_gdn_prep,
    gdn_dots_for,
    invert_compiles_for,
    writes_padding_zeros,
)
from engine.kernels.forest_tables import (
    BLOCK_M,
    CONV_ROW,
    CONV_TAIL,
    CONV_ZERO,
    QB_LIVE,
    QB_LOCAL,
    QB_SEG,
    QBLOCK_FIELDS,
    ROW_FIELDS,
    ROW_LIVE,
    ROW_LOCAL,
    ROW_SEG,
    ROW_TOKEN,
    SEG_CONV_OUT,
    SEG_FIELDS,
    SEG_HAS_STATE_IN,
    SEG_LENGTH,
    SEG_LEVEL,
    SEG_LIVE,
    SEG_STATE_IN,
    SEG_STATE_OUT,
    SEG_TOK_LO,
)
from engine.kernels.vocab_mass import PassReads
from engine.model.weights import Weights
from engine.run.executor import ForestCounters, ForestOutput
from engine.run.forest import Forest, SegmentState
from engine.run.graphs import fit
from engine.run.layers import AttentionInputs, GdnInputs, Int8Layers
from engine.run.rope import rope_rows, rope_table

log = structlog.get_logger(__name__)

# Rows a pass computes. Every linear runs on all of them and at 27B the linears are compute
# bound from a few hundred rows on, so padding costs time in proportion: steps of 64 rows up to
# 1,024 (the one- and few-question requests), then at most 1.25x. Each size used captures a graph.
TOKEN_BUCKETS = (
    16, 32, *range(64, 1025, 64), 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
    5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384,
)  # fmt: skip
SEGMENT_BUCKETS = (4, 16, 64, 256)
PIECE_BUCKETS = (4, 8)
# How the last layer runs (`ForestBody(last_layer=)`): "reads" computes every row's state (K/V,
# DeltaNet state) but the rest of the layer - query, attention, output projection, MLP - at the
# read rows only (`engine.run.layers.Int8Layers._last_layer_at_reads`); "full" runs it on every
# row and picks the read rows after it (the former pass, for benchmarks and tests).
LAST_LAYERS = ("reads", "full")
# The bucket's (and a plan's) read-slot tables (`ForestBody._read_tables`), packed with the rest.
READ_TABLES = ("read_rows", "read_decode", "read_pieces")

# How a pass's host side builds and uploads its tables (`ForestBody.host_tables`, flipped on a live
# body by the benches): "packed" - numpy tables, every table of a bucket uploaded in one copy from a
# pinned buffer, RoPE rows gathered on the device, segment states whose per-layer views are made on
# first access; "lists" - Python lists turned into tensors, one pageable upload per table, RoPE rows
# from the host, every view made up front (the session-10 path). The same tables and the same bits.
HOST_TABLES = ("packed", "lists")
# A bucket's int64 tables that live in its one packed device buffer, with the axis along which a
# plan fills a leading part (rows, segment slots or query blocks; the rest is padding). The plan's
# fields of the same names hold a pass's values; `positions` [T] is the packed buffer's own (the
# RoPE gather reads it).
PACKED_TABLES = (
    ("rows", 0), ("segs", 0), ("conv_src", 0), ("pieces", 1), ("qblocks", 0), ("reads", 0), ("positions", 0),
    ("read_rows", 0), ("read_decode", 0), ("read_pieces", 0),
)  # fmt: skip


_LEADING = ((), (slice(None),))  # index prefixes that reach a PACKED_TABLES axis (0 or 1)

# Whether a CUDA body's captured buckets make their read-outs' numbers in the pass (`PassReads`:
# every read slot's vocabulary partials and its logits at the letter ids `read_out_letters` named,
# copied back by the graph), so a read-out after the pass launches nothing. The same values; a
# bench flips it before making a body (variant `tc64inv-hostreads`).
READS_IN_PASS = True


def forest_counters(forest: Forest) -> ForestCounters:
    """Per level its tokens and segments, and the read positions (whole columns: a loop over
    the segments of each level cost 0.3 ms at 64 clients)."""
    counters = ForestCounters(read_positions=len(forest.read_segments))
    if forest.segments:
        levels = forest.levels.numpy()
        # a weighted bincount sums in fp64: exact for any count below 2^53 (np.add.at took ~8 us)
        tokens = np.bincount(levels, weights=np.diff(forest.offsets.numpy()))
        counters.tokens_per_level = tokens.astype(np.int64).tolist()
        counters.segments_per_level = np.bincount(levels).tolist()
    return counters


@dataclass(frozen=True)
class _StateShape:
    """How a body lays out a segment's output block: what a state made by one body needs for another
    body (same model sizes, same device) to read its offsets from the block instead of its views."""

    device: torch.device
    attn_layers: tuple[int, ...]
    gdn_layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    state: tuple[int, int, int]  # value heads, key dim, value dim
    conv: tuple[int, int]  # conv channels, W - 1

    def kv_size(self, n: int) -> int:
        """fp32 elements of one of K or V of an n-token segment, over every attention layer."""
        return len(self.attn_layers) * self.kv_heads * n * self.head_dim

    def state_size(self) -> int:
        nv, dk, dv = self.state
        return nv * dk * dv

    def block_size(self, n: int) -> int:
        tail = self.conv[0] * self.conv[1]
        return 2 * self.kv_size(n) + len(self.gdn_layers) * (self.state_size() + tail)


_VIEW_FIELDS = ("keys", "values", "recurrent", "conv")


class _BlockState(SegmentState):
    """A body-made `SegmentState` whose per-layer tensors are views of its one output block, made
    the first time anything reads them.

    Why: a 27B segment has 128 per-layer views (K and V of 16 attention layers, state and conv
    tail of 48 DeltaNet layers); making them took ~0.1 ms a segment on the host path every pass
    waits for, and most question segments' states are never read (a thought reads them when it
    starts). The body itself reads a state's offsets from its block (`block_offset`), never from
    the views, unless something replaced them (`views_intact`).
    """

    def __init__(
        self, parent: SegmentState | None, start: int, length: int, block: torch.Tensor, shape: _StateShape
    ) -> None:
        super().__init__(parent=parent, start=start, length=length)
        d = self.__dict__
        for name in _VIEW_FIELDS:  # made on first access (__getattr__)
            del d[name]
        d["_block"], d["_shape"], d["_made"] = block, shape, None

    def __getattr__(self, name: str) -> Any:
        # only reached for what normal lookup did not find: the views before they are made
        d = self.__dict__
        if name in _VIEW_FIELDS and "_shape" in d and d["_made"] is None:
            self._make_views()
            return d[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _make_views(self) -> None:
        shape, block, n = self.__dict__["_shape"], self.__dict__["_block"], self.length
        n_attn, n_gdn = len(shape.attn_layers), len(shape.gdn_layers)
        kv, size = shape.kv_size(n), shape.state_size()
        keys = block[:kv].view(n_attn, shape.kv_heads, n, shape.head_dim)
        values = block[kv : 2 * kv].view(n_attn, shape.kv_heads, n, shape.head_dim)
        recurrent = block[2 * kv : 2 * kv + n_gdn * size].view(n_gdn, *shape.state)
        conv = block[2 * kv + n_gdn * size :].view(n_gdn, *shape.conv)
        # unbind: every layer's view in one call (a Python index per layer cost ~1 us each)
        made = {
            "keys": dict(zip(shape.attn_layers, keys.unbind(0), strict=True)),
            "values": dict(zip(shape.attn_layers, values.unbind(0), strict=True)),
            "recurrent": dict(zip(shape.gdn_layers, recurrent.unbind(0), strict=True)),
            "conv": dict(zip(shape.gdn_layers, conv.unbind(0), strict=True)),
        }
        self.__dict__.update(made)
        self.__dict__["_made"] = {name: tuple(views.values()) for name, views in made.items()}

    def views_intact(self) -> bool:
        """Whether every per-layer tensor is still the block's own view (or none was made yet)."""
        made = self.__dict__["_made"]
        if made is None:
            return True
        for name, views in made.items():
            now = self.__dict__[name]
            if len(now) != len(views) or not all(map(operator.is_, now.values(), views)):
                return False
        return True

    def block_offset(self, shape: _StateShape, base: torch.Tensor) -> int | None:
        """The block's offset from `base` when the block still holds this state's tensors in
        `shape`'s layout (else None: read the views)."""
        d = self.__dict__
        if d["_shape"] != shape or not self.views_intact():
            return None
        return element_offset(d["_block"], base)

    def piece_records(self, shape: _StateShape, base: torch.Tensor) -> np.ndarray | None:
        """[n_attn, PIECE_FIELDS] piece records of this state's own K/V read from its block (None
        where `block_offset` is None: read the views). Kept for the next plan (read-only): a cached
        parent - the system root, kept evidence - is in every pass's chains, and its records depend
        only on the block's offset, the layout and the length (~6 us a node to make)."""
        at = self.block_offset(shape, base)
        if at is None:
            return None
        d = self.__dict__
        memo = d.get("_records")
        if memo is not None and memo[0] == at and memo[1] == shape:
            return memo[2]
        n_attn, n = len(shape.attn_layers), self.length
        records = np.empty((n_attn, PIECE_FIELDS), dtype=np.int64)
        records[:, 0] = at + np.arange(n_attn) * (shape.kv_heads * n * shape.head_dim)
        records[:, 1] = records[:, 0] + shape.kv_size(n)
        records[:, 2] = records[:, 3] = n
        records.flags.writeable = False
        d["_records"] = (at, shape, records)
        return records

    def nbytes(self) -> int:
        if self.__dict__["_made"] is None:  # the views would cover the block exactly
            block = self.__dict__["_block"]
            return block.numel() * block.element_size()
        return super().nbytes()


@dataclass(eq=False)
class _Staging:
    """A bucket's packed tables: one int64 device buffer whose views are the bucket's tables, its
    pinned host twin (the same buffer on CPU), and what the last packed load filled."""

    host: torch.Tensor
    device: torch.Tensor
    host_views: dict[str, np.ndarray]
    positions: torch.Tensor  # the device view the RoPE gather reads
    used: dict[str, int]  # per table: leading entries along its axis the last load wrote
    copied: torch.cuda.Event | None = None  # after the last upload: the host buffer is free again


@dataclass(eq=False)
class _Bucket:
    """Static tables (and, on CUDA, the captured graph) of one (T, S, P, levels) shape."""

    tokens: int
    slots: int
    pieces_per_segment: int
    levels: int
    rows: torch.Tensor  # [T, ROW_FIELDS]
    segs: torch.Tensor  # [S, SEG_FIELDS]
    conv_src: torch.Tensor  # [S, W - 1, 2]
    pieces: torch.Tensor  # [n_attn, S, P, PIECE_FIELDS]
    qblocks: torch.Tensor  # [Q, QBLOCK_FIELDS]
    reads: torch.Tensor  # [S] packed rows whose logits are returned
    rope: torch.Tensor  # [T, 2, rope_dims] fp32 (cos, sin)
    # The read slots' tables for a last attention layer run at the read rows (`_read_tables`);
    # read slot r is the r-th read row, padding slots are zeros (live 0: nothing attended or stored)
    read_rows: torch.Tensor  # [S, ROW_FIELDS] the read row's record of `rows` (the query prep's)
    read_decode: torch.Tensor  # [S, decode ROW_FIELDS] as a decode row: thought_len = local index
    read_pieces: torch.Tensor  # [S, P, PIECE_FIELDS] the last attention layer's pieces of its segment
    logits: torch.Tensor | None = None  # the graph's output
    graph: torch.cuda.CUDAGraph | None = None
    staging: _Staging | None = None  # the packed tables (`ForestBody._pack`)
    read_out: PassReads | None = None  # the read-outs' numbers made in the pass (`READS_IN_PASS`)


@dataclass
class _Plan:
    """Host-side tables of one forest, before they are copied into a bucket."""

    rows: torch.Tensor
    segs: torch.Tensor
    conv_src: torch.Tensor
    pieces: torch.Tensor
    qblocks: torch.Tensor
    reads: torch.Tensor
    positions: torch.Tensor
    levels: int
    positions_end: int | None = None  # the largest position + 1 (None: read from `positions`)
    read_rows: torch.Tensor | None = None  # the read slots' tables (`_read_tables`)
    read_decode: torch.Tensor | None = None
    read_pieces: torch.Tensor | None = None
    # copies the tables point at: alive until the pass is enqueued; the caching allocator reuses
    # their memory only for work queued after it on the same stream, so no sync is needed
    held: list[torch.Tensor] = field(default_factory=list)


class ForestBody(Int8Layers):
    """One-pass forest execution for int8 weights on one device (see the module docstring)."""

    host_tables: str = "packed"  # one of HOST_TABLES; a bench may set it on an instance

    def __init__(
        self,
        weights: Weights,
        *,
        graphs: bool | None = None,
        gdn_chunk: int = 0,
        gdn_dots: str = "ieee",
        attention_dots: str = "ieee",
        gdn_prep: str = "blocks",
        last_layer: str = "reads",
        read_splits: int = 1,
    ) -> None:
        """gdn_chunk: 0 runs the recurrence token by token; C > 0 in chunks of C tokens
        (`engine.kernels.forest_gdn`: the same recurrence in another summation order), whose
        matrix products run at `gdn_dots` precision (`gdn_dots_for(C)`: C = 64 is the
        tensor-core form, bf16 or tf32 operands). attention_dots: the precision of
        the attention dots (`engine.kernels.forest_attention.ATTENTION_DOTS`). gdn_prep: which
        kernel makes the chunk-64 form's state-free products (`TC_PREP_FORMS`: "blocks", 16-row
        block substitution, or "invert", whole-chunk products and a blocked inverse; other
        rounding points, the same products; "auto": invert where it runs compiled at the model's
        head sizes, `invert_compiles_for`, else blocks - a function of the model alone). Each
        setting changes rounding, never invariance: a segment's bits still depend on its own
        inputs.

        last_layer (`LAST_LAYERS`): "reads" runs the last layer's query, attention, output
        projection and MLP at the read rows only (every row's K/V and DeltaNet states are still
        computed, with the full layer's bits); "full" the whole layer on every row. A read row's
        attention then runs in the decode kernel (`engine.kernels.decode_attention`: one query
        row over its chain's pieces) with `read_splits` programs per (row, KV head) over its
        keys: 1 folds each piece whole in one program, with the forest kernel's warps - the same
        operations in the same order as the 16-row forest kernel, so the full layer's bits in the
        interpreter (tested); more (the decoder's SPLITS) cut a long chain's keys over that many
        programs, folded in another order: other rounding, the same invariance. Segments the full
        layer's large-block kernel attends (tensor-core dots, `forest_attention.LongConfig.
        min_length` tokens on) round otherwise under either setting.
        """
        if last_layer not in LAST_LAYERS:
            raise ValueError(f"last_layer must be one of {LAST_LAYERS}, got {last_layer!r}")
        if read_splits < 1:
            raise ValueError(f"read_splits must be >= 1, got {read_splits}")
        gdn_allowed = gdn_dots_for(gdn_chunk)
        if gdn_prep not in (*TC_PREP_FORMS, "auto"):
            raise ValueError(f"gdn_prep must be one of {TC_PREP_FORMS} or 'auto', got {gdn_prep!r}")
        if gdn_dots not in gdn_allowed or attention_dots not in ATTENTION_DOTS:
            raise ValueError(
                f"gdn_dots must be one of {gdn_allowed} (gdn_chunk {gdn_chunk}) and attention_dots one "
                f"of {ATTENTION_DOTS}, got {gdn_dots!r} and {attention_dots!r}"
            )
        self._bind(weights, graphs, "forest body")
        c = self.config
        self.width = c.conv_kernel
        # every offset in the tables is relative to this tensor
        self.base = torch.zeros(64, dtype=torch.float32, device=self.device)
        self._buckets: dict[tuple[int, int, int, int], _Bucket] = {}
        self._rope_rows: torch.Tensor | None = None  # the last `rope_table` a packed load read
        self.passes = 0
        # read-out numbers in the pass: on CUDA (READS_IN_PASS), once `read_out_letters` names the
        # letters; a CPU test may set it (its kernels then run in the interpreter)
        self.reads_in_pass = READS_IN_PASS and self.device.type == "cuda"
        self._read_letter_ids: tuple[int, ...] | None = None
        self.gdn_chunk = gdn_chunk
        self.gdn_dots = gdn_dots
        if gdn_prep == "auto":
            fits = invert_compiles_for(c.linear_key_head_dim, c.linear_value_head_dim)
            gdn_prep = "invert" if fits else "blocks"
        self.gdn_prep = gdn_prep
        self.attention_dots = attention_dots
        self.last_layer = last_layer
        self.read_splits = read_splits
        self.reads_only_last = last_layer == "reads"
        last = c.num_layers - 1
        # the last layer's attention index when it is attention run at the read rows (read tables)
        self._read_attn = (
            self._attn_index[last] if self.reads_only_last and c.is_full_attention(last) else None
        )

    # ------------------------------------------------------------------------------ public
    def run(self, forest: Forest) -> ForestOutput:
        """Every segment of `forest` in one pass: logits at the read positions and the states."""
        if any(seg.images is not None for seg in forest.segments):
            # Its device tables have no image rows or 3-axis positions: the engine runs evidence
            # holding images through the level executor first (`engine.stages.Stages._read_stage`).
            raise ValueError("the one-pass body does not take segments holding images")
        counters = forest_counters(forest)
        if not forest.segments:
            return ForestOutput(torch.zeros(0, self.config.vocab_size), [], counters)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            states, blocks = self._allocate(forest)
            plan = self._plan(forest, states, blocks)
            logits = self._execute(plan, forest.num_tokens, len(forest.segments))
        return ForestOutput(logits=logits, states=states, counters=counters)

    def read_out_letters(self, letter_ids: list[int] | tuple[int, ...]) -> None:
        """The token ids (the letters A..Z) whose logits buckets made from now on gather in the
        pass, beside every read slot's vocabulary partials (`reads_in_pass`); a read-out of other
        ids, or of a bucket made before, runs its kernels after the pass as before. Set it before
        the first pass (the engine's stages do, before the system prefix runs)."""
        ids = tuple(int(i) for i in letter_ids)
        vocab = self.config.vocab_size
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < vocab for i in ids):
            raise ValueError(f"letter ids must be distinct and in [0, {vocab}), got {list(ids)}")
        self._read_letter_ids = ids

    # ------------------------------------------------------------------------------ outputs
    def _allocate(self, forest: Forest) -> tuple[list[SegmentState], list[torch.Tensor]]:
        """Each segment's output block and the `SegmentState` whose tensors are views of it."""
        if self.host_tables == "lists":
            return self._allocate_views(forest)
        return self._allocate_blocks(forest)

    @cached_property
    def _state_shape(self) -> _StateShape:
        c = self.config
        return _StateShape(
            device=self.device,
            attn_layers=tuple(self.attn_layers),
            gdn_layers=tuple(self.gdn_layers),
            kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            state=(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
            conv=(c.conv_dim, c.conv_kernel - 1),
        )

    def _allocate_blocks(self, forest: Forest) -> tuple[list[SegmentState], list[torch.Tensor]]:
        """The blocks, and states whose views are made when first read (`_BlockState`)."""
        shape, dev = self._state_shape, self.device
        parents, starts = forest.parents.tolist(), forest.starts.tolist()
        states: list[SegmentState] = []
        blocks: list[torch.Tensor] = []
        for s, seg in enumerate(forest.segments):
            n = len(seg.tokens)  # the forest's offsets' difference (torch ops on them cost ~10 us)
            block = torch.empty(shape.block_size(n), device=dev)
            p = parents[s]
            parent = states[p] if p >= 0 else seg.parent
            parent = parent if isinstance(parent, SegmentState) else None
            states.append(_BlockState(parent, starts[s], n, block, shape))
            blocks.append(block)
        return states, blocks

    def _allocate_views(self, forest: Forest) -> tuple[list[SegmentState], list[torch.Tensor]]:
        """The "lists" form: every state's per-layer views made here."""
        c, dev = self.config, self.device
        n_attn, n_gdn = len(self.attn_layers), len(self.gdn_layers)
        nkv, hd = c.num_kv_heads, c.head_dim
        states: list[SegmentState] = []
        blocks: list[torch.Tensor] = []
        for s, seg in enumerate(forest.segments):
            n = len(seg.tokens)
            kv = n_attn * nkv * n * hd
            block = torch.empty(2 * kv + n_gdn * (self.state_size + self.tail_size), device=dev)
            p = int(forest.parents[s])
            parent = states[p] if p >= 0 else seg.parent
            st = SegmentState(
                parent=parent if isinstance(parent, SegmentState) else None,
                start=int(forest.starts[s]),
                length=n,
            )
            keys = block[:kv].view(n_attn, nkv, n, hd)
            values = block[kv : 2 * kv].view(n_attn, nkv, n, hd)
            rest = 2 * kv
            recurrent = block[rest : rest + n_gdn * self.state_size].view(
                n_gdn, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
            )
            conv = block[rest + n_gdn * self.state_size :].view(n_gdn, c.conv_dim, c.conv_kernel - 1)
            # unbind: every layer's view in one call (a Python index per layer cost ~1 us each)
            st.keys.update(zip(self.attn_layers, keys.unbind(0), strict=True))
            st.values.update(zip(self.attn_layers, values.unbind(0), strict=True))
            st.recurrent.update(zip(self.gdn_layers, recurrent.unbind(0), strict=True))
            st.conv.update(zip(self.gdn_layers, conv.unbind(0), strict=True))
            states.append(st)
            blocks.append(block)
        return states, blocks

    # ------------------------------------------------------------------------------ tables
    def _offset(self, t: torch.Tensor) -> int:
        return element_offset(t, self.base)

    def _readable(self, t: torch.Tensor, held: list[torch.Tensor]) -> torch.Tensor:
        """t as contiguous fp32 on the device (a copy kept in `held` only when it is not already)."""
        if t.device == self.device and t.dtype == torch.float32 and t.is_contiguous():
            return t
        copy = t.to(self.device, torch.float32).contiguous()
        held.append(copy)
        return copy

    def _stacked(
        self,
        per_layer: dict[int, torch.Tensor],
        layers: list[int],
        held: list[torch.Tensor],
        known: dict[int, int],
    ) -> int:
        """Offset of the block [n_layers, ...] holding per_layer's tensors back to back (a copy
        when they do not already lie that way, as states made by this pass do); memoized in
        `known` for the plan, as many segments of a batch share one cached parent."""
        if id(per_layer) in known:
            return known[id(per_layer)]
        known[id(per_layer)] = offset = self._stacked_offset(per_layer, layers, held)
        return offset

    def _stacked_offset(
        self, per_layer: dict[int, torch.Tensor], layers: list[int], held: list[torch.Tensor]
    ) -> int:
        ts = [per_layer[i] for i in layers]
        first = ts[0]
        size = first.numel()
        in_place = all(
            t.device == self.device and t.dtype == torch.float32 and t.is_contiguous() for t in ts
        ) and all(t.data_ptr() == first.data_ptr() + j * size * 4 for j, t in enumerate(ts))
        if in_place:
            return self._offset(first)
        copy = torch.stack([t.to(self.device, torch.float32) for t in ts]).contiguous()
        held.append(copy)
        return self._offset(copy)

    def _plan(self, forest: Forest, states: list[SegmentState], blocks: list[torch.Tensor]) -> _Plan:
        """The forest's tables on the host (`engine.kernels.forest_tables`), offsets into `blocks`."""
        if self.host_tables == "lists":
            plan = self._plan_lists(forest, states, blocks)
        else:
            plan = self._plan_packed(forest, states, blocks)
        self._read_tables(plan)
        return plan

    def _read_tables(self, plan: _Plan) -> None:
        """The read slots' tables of a plan, for a last attention layer run at the read rows
        (`_attend_reads`; left None otherwise): per read row its record of `plan.rows`, the same
        row as a decode row (`engine.kernels.decode_rows`: thought_len = its local index, so the
        decode kernel reads own keys 0 .. local; live) and its segment's pieces of that layer
        (ancestors whole, the own K/V block last), which the decode kernel reads in place."""
        if self._read_attn is None:
            return
        reads = plan.reads.numpy()
        rows = plan.rows.numpy()[reads]
        decode = np.zeros((reads.shape[0], DECODE_ROW_FIELDS), dtype=np.int64)
        decode[:, THOUGHT_LEN], decode[:, LIVE] = rows[:, ROW_LOCAL], rows[:, ROW_LIVE]
        plan.read_rows = torch.from_numpy(rows)
        plan.read_decode = torch.from_numpy(decode)
        plan.read_pieces = torch.from_numpy(plan.pieces.numpy()[self._read_attn][rows[:, ROW_SEG]])

    def _plan_lists(self, forest: Forest, states: list[SegmentState], blocks: list[torch.Tensor]) -> _Plan:
        c = self.config
        w1 = self.width - 1
        n_seg = len(forest.segments)
        n_attn, n_gdn = len(self.attn_layers), len(self.gdn_layers)
        held: list[torch.Tensor] = []
        offsets = forest.offsets.tolist()
        lengths = [offsets[s + 1] - offsets[s] for s in range(n_seg)]
        parents = forest.parents.tolist()
        levels = forest.levels.tolist()

        seg_of = torch.repeat_interleave(torch.arange(n_seg), torch.tensor(lengths))
        local = torch.arange(forest.num_tokens) - forest.offsets[seg_of]
        rows = torch.stack([seg_of, local, torch.ones_like(local), forest.tokens.to(torch.int64)], dim=1)
        positions = forest.starts[seg_of] + local

        segs: list[list[int]] = []
        conv_src: list[list[tuple[int, int]]] = []
        chains: list[list[SegmentState]] = []
        history: list[list[tuple[int, int]]] = []  # the last W-1 inputs up to each segment's end
        qblocks: list[tuple[int, int, int]] = []
        own_pieces: dict[int, list[list[int]]] = {}  # id(state) -> per attention layer record
        stacked: dict[int, int] = {}  # id(a cached parent's per-layer dict) -> its block offset
        for s in range(n_seg):
            lo, n = offsets[s], lengths[s]
            kv = n_attn * c.num_kv_heads * n * c.head_dim
            block = self._offset(blocks[s])
            own_pieces[id(states[s])] = [
                [block + a * (kv // n_attn), block + kv + a * (kv // n_attn), n, n] for a in range(n_attn)
            ]
            record = [0] * SEG_FIELDS
            record[SEG_TOK_LO], record[SEG_LENGTH], record[SEG_LEVEL] = lo, n, levels[s]
            record[SEG_STATE_OUT] = block + 2 * kv
            record[SEG_CONV_OUT] = block + 2 * kv + n_gdn * self.state_size
            record[SEG_LIVE] = 1
            p = parents[s]
            outside = forest.segments[s].parent
            if p >= 0:
                record[SEG_STATE_IN], record[SEG_HAS_STATE_IN] = segs[p][SEG_STATE_OUT], 1
                before = history[p]
                chains.append([*chains[p], states[s]])
            elif isinstance(outside, SegmentState):
                record[SEG_STATE_IN] = self._stacked(outside.recurrent, self.gdn_layers, held, stacked)
                record[SEG_HAS_STATE_IN] = 1
                tail = self._stacked(outside.conv, self.gdn_layers, held, stacked)
                before = [(CONV_TAIL, tail + k) for k in range(w1)]
                chains.append([*outside.chain(), states[s]])
            else:
                before = [(CONV_ZERO, 0)] * w1
                chains.append([states[s]])
            segs.append(record)
            conv_src.append(before)
            history.append([*before, *((CONV_ROW, lo + k) for k in range(max(0, n - w1), n))][-w1:])
            qblocks.extend((s, b, 1) for b in range(0, n, BLOCK_M))

        depth = max(len(ch) for ch in chains)
        p_size, _ = fit(depth, PIECE_BUCKETS)
        empty = [[0, 0, 0, 0]] * n_attn
        table = []  # [S][P][n_attn][fields]
        for chain in chains:
            records = [self._pieces_of(node, own_pieces, held) for node in chain]
            table.append([*records[:-1], *[empty] * (p_size - len(chain)), records[-1]])
        pieces = torch.tensor(table, dtype=torch.int64).view(n_seg, p_size, n_attn, PIECE_FIELDS)
        return _Plan(
            rows=rows,
            segs=torch.tensor(segs, dtype=torch.int64),
            conv_src=torch.tensor(conv_src, dtype=torch.int64).view(n_seg, w1, 2),
            pieces=pieces.permute(2, 0, 1, 3).contiguous(),
            qblocks=torch.tensor(qblocks, dtype=torch.int64).view(-1, QBLOCK_FIELDS),
            reads=forest.read_positions.to(torch.int64),
            positions=positions,
            levels=forest.num_levels,
            held=held,
        )

    def _pieces_of(
        self, node: SegmentState, known: dict[int, list[list[int]]], held: list[torch.Tensor]
    ) -> list[list[int]]:
        """Per attention layer, the piece record of node's own K/V (memoized in `known`)."""
        if id(node) not in known:
            records = []
            for i in self.attn_layers:
                k = self._readable(node.keys[i], held)
                v = self._readable(node.values[i], held)
                records.append([self._offset(k), self._offset(v), int(k.shape[1]), int(k.shape[1])])
            known[id(node)] = records
        return known[id(node)]

    def _plan_packed(self, forest: Forest, states: list[SegmentState], blocks: list[torch.Tensor]) -> _Plan:
        """The tables as numpy arrays (the values `_plan_lists` gives): whole columns at once, and
        a state's offsets from its block where the body made it (`_BlockState.block_offset`).

        Host cost: this runs before every pass and nothing of it overlaps the GPU, so the few
        per-segment values (state offsets, conv sources, chain depths) are Python lists, the
        per-row and per-piece tables numpy columns, and a child's ancestor pieces one slice of its
        parent's (`numpy` calls cost ~1 us each at these sizes; a loop of small ones added up)."""
        shape = self._state_shape
        w1 = self.width - 1
        n_seg, n_tok = len(forest.segments), forest.num_tokens
        n_attn, n_gdn = len(self.attn_layers), len(self.gdn_layers)
        held: list[torch.Tensor] = []
        offsets = forest.offsets.numpy()
        lo, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
        lo_of, length_of, parents = lo.tolist(), lengths.tolist(), forest.parents.tolist()
        starts_of = forest.starts.tolist()

        seg_of = np.repeat(np.arange(n_seg, dtype=np.int64), lengths)
        rows = np.empty((n_tok, ROW_FIELDS), dtype=np.int64)
        rows[:, ROW_SEG], rows[:, ROW_LIVE], rows[:, ROW_TOKEN] = seg_of, 1, forest.tokens.numpy()
        counting = np.arange(n_tok, dtype=np.int64)
        local = np.subtract(counting, lo[seg_of], out=rows[:, ROW_LOCAL])
        positions = forest.starts.numpy()[seg_of] + local

        block = np.array([self._offset(b) for b in blocks], dtype=np.int64)
        kv_layer = shape.kv_heads * shape.head_dim * lengths  # one attention layer's K (or V)
        kv = n_attn * kv_layer
        state_out = block + 2 * kv
        out_of = state_out.tolist()

        # per segment, in packed order (a parent before its children): where its recurrent state
        # and conv inputs come from, and its chain's depth (ancestors' pieces, then its own)
        state_in, has_state_in = [0] * n_seg, [0] * n_seg
        conv_rows: list[list[tuple[int, int]]] = []
        history: list[list[tuple[int, int]]] = []  # the last W-1 inputs up to each segment's end
        depth = [1] * n_seg
        outside_records: dict[int, list[np.ndarray]] = {}  # root segment -> its outside chain's records
        known: dict[int, np.ndarray] = {}  # id(state outside the forest) -> its piece records
        stacked: dict[int, int] = {}  # id(a cached parent's per-layer dict) -> its block offset
        for s in range(n_seg):
            p, n, first = parents[s], length_of[s], lo_of[s]
            outside = forest.segments[s].parent
            if p >= 0:
                state_in[s], has_state_in[s] = out_of[p], 1
                before = history[p]
                depth[s] = depth[p] + 1
            elif isinstance(outside, SegmentState):
                state_in[s], tail = self._state_offsets(outside, held, stacked)
                has_state_in[s] = 1
                before = [(CONV_TAIL, tail + k) for k in range(w1)]
                records = [self._records(node, known, held) for node in outside.chain()]
                outside_records[s] = records
                depth[s] = len(records) + 1
            else:
                before = [(CONV_ZERO, 0)] * w1
            conv_rows.append(before)
            history.append([*before, *((CONV_ROW, first + k) for k in range(max(0, n - w1), n))][-w1:])
        conv_src = np.array(conv_rows, dtype=np.int64).reshape(n_seg, w1, 2)

        segs = np.zeros((n_seg, SEG_FIELDS), dtype=np.int64)
        segs[:, SEG_TOK_LO], segs[:, SEG_LENGTH], segs[:, SEG_LEVEL] = lo, lengths, forest.levels.numpy()
        segs[:, SEG_STATE_IN], segs[:, SEG_HAS_STATE_IN] = state_in, has_state_in
        segs[:, SEG_STATE_OUT], segs[:, SEG_CONV_OUT] = state_out, state_out + n_gdn * self.state_size
        segs[:, SEG_LIVE] = 1

        qb_seg: list[int] = []
        qb_local: list[int] = []
        for s, n in enumerate(length_of):
            starts = range(0, n, BLOCK_M)
            qb_seg += [s] * len(starts)
            qb_local += starts
        qblocks = np.empty((len(qb_seg), QBLOCK_FIELDS), dtype=np.int64)
        qblocks[:, QB_SEG], qblocks[:, QB_LOCAL], qblocks[:, QB_LIVE] = qb_seg, qb_local, 1

        p_size, _ = fit(max(depth), PIECE_BUCKETS)
        pieces = np.zeros((n_attn, n_seg, p_size, PIECE_FIELDS), dtype=np.int64)  # unused: length 0
        # every segment's own piece per attention layer, last: its K/V block, read causally
        own = pieces[:, :, p_size - 1]
        own[:, :, 0] = block[None, :] + np.arange(n_attn, dtype=np.int64)[:, None] * kv_layer[None, :]
        own[:, :, 1] = own[:, :, 0] + kv[None, :]
        own[:, :, 2] = own[:, :, 3] = lengths[None, :]
        for s in range(n_seg):  # the ancestors' pieces, oldest first
            p = parents[s]
            if p >= 0:  # the parent's ancestors, then the parent's own piece
                d = depth[p] - 1
                pieces[:, s, :d] = pieces[:, p, :d]
                pieces[:, s, d] = own[:, p]
            elif s in outside_records:
                for j, records in enumerate(outside_records[s]):
                    pieces[:, s, j] = records
        return _Plan(
            rows=torch.from_numpy(rows),
            segs=torch.from_numpy(segs),
            conv_src=torch.from_numpy(conv_src),
            pieces=torch.from_numpy(pieces),
            qblocks=torch.from_numpy(qblocks),
            reads=forest.read_positions.to(torch.int64),
            positions=torch.from_numpy(positions),
            levels=forest.num_levels,
            positions_end=max(map(operator.add, starts_of, length_of), default=None),
            held=held,
        )

    def _state_offsets(
        self, state: SegmentState, held: list[torch.Tensor], stacked: dict[int, int]
    ) -> tuple[int, int]:
        """Offsets of a parent's stacked recurrent states and conv tails (from its block when the
        body made it, else as `_plan_lists` finds them)."""
        at = state.block_offset(self._state_shape, self.base) if isinstance(state, _BlockState) else None
        if at is not None:
            state_in = at + 2 * self._state_shape.kv_size(state.length)
            return state_in, state_in + len(self.gdn_layers) * self.state_size
        state_in = self._stacked(state.recurrent, self.gdn_layers, held, stacked)
        return state_in, self._stacked(state.conv, self.gdn_layers, held, stacked)

    def _records(
        self, node: SegmentState, known: dict[int, np.ndarray], held: list[torch.Tensor]
    ) -> np.ndarray:
        """[n_attn, PIECE_FIELDS] piece records of node's own K/V (memoized in `known`)."""
        if id(node) not in known:
            records = None
            if isinstance(node, _BlockState):
                records = node.piece_records(self._state_shape, self.base)
            if records is None:
                records = np.array(self._pieces_of(node, {}, held), dtype=np.int64)
            known[id(node)] = records
        return known[id(node)]

    # ------------------------------------------------------------------------------ buckets
    def _bucket(self, tokens: int, slots: int, pieces_per_segment: int, levels: int) -> tuple[_Bucket, bool]:
        t, t_ok = fit(tokens, TOKEN_BUCKETS)
        s, s_ok = fit(slots, SEGMENT_BUCKETS)
        key = (t, s, pieces_per_segment, levels)
        capturable = t_ok and s_ok and pieces_per_segment in PIECE_BUCKETS
        if key in self._buckets:
            return self._buckets[key], capturable
        c, dev = self.config, self.device
        bucket = _Bucket(
            tokens=t,
            slots=s,
            pieces_per_segment=pieces_per_segment,
            levels=levels,
            rows=torch.zeros(t, ROW_FIELDS, dtype=torch.int64, device=dev),
            segs=torch.zeros(s, SEG_FIELDS, dtype=torch.int64, device=dev),
            conv_src=torch.zeros(s, self.width - 1, 2, dtype=torch.int64, device=dev),
            pieces=torch.zeros(
                len(self.attn_layers), s, pieces_per_segment, PIECE_FIELDS, dtype=torch.int64, device=dev
            ),
            qblocks=torch.zeros(t // BLOCK_M + s, QBLOCK_FIELDS, dtype=torch.int64, device=dev),
            reads=torch.zeros(s, dtype=torch.int64, device=dev),
            rope=torch.zeros(t, 2, c.rope_dims, device=dev),
            read_rows=torch.zeros(s, ROW_FIELDS, dtype=torch.int64, device=dev),
            read_decode=torch.zeros(s, DECODE_ROW_FIELDS, dtype=torch.int64, device=dev),
            read_pieces=torch.zeros(s, pieces_per_segment, PIECE_FIELDS, dtype=torch.int64, device=dev),
        )
        self._pack(bucket)
        if capturable:
            self._buckets[key] = bucket  # one-off shapes are not kept
            if self.reads_in_pass and self._read_letter_ids is not None:
                bucket.read_out = PassReads(s, c.vocab_size, self._read_letter_ids, dev)
        return bucket, capturable

    def _load(self, bucket: _Bucket, plan: _Plan | None) -> None:
        """Copy a plan's tables into the bucket's static tensors (None: all padding)."""
        if self.host_tables == "lists":
            self._load_lists(bucket, plan)
        else:
            self._load_packed(bucket, plan)

    def _load_lists(self, bucket: _Bucket, plan: _Plan | None) -> None:
        t, s = bucket.tokens, bucket.slots
        rows = torch.zeros(t, ROW_FIELDS, dtype=torch.int64)
        segs = torch.zeros(s, SEG_FIELDS, dtype=torch.int64)
        conv_src = torch.zeros(s, self.width - 1, 2, dtype=torch.int64)
        pieces = torch.zeros(bucket.pieces.shape, dtype=torch.int64)
        qblocks = torch.zeros(bucket.qblocks.shape, dtype=torch.int64)
        reads = torch.zeros(s, dtype=torch.int64)
        positions = torch.zeros(t, dtype=torch.int64)
        read_tables = [torch.zeros_like(getattr(bucket, name), device="cpu") for name in READ_TABLES]
        if plan is not None:
            n, m = plan.rows.shape[0], plan.segs.shape[0]
            rows[:n], segs[:m], conv_src[:m] = plan.rows, plan.segs, plan.conv_src
            pieces[:, :m] = plan.pieces
            qblocks[: plan.qblocks.shape[0]] = plan.qblocks
            reads[: plan.reads.numel()] = plan.reads
            positions[:n] = plan.positions
            for host, name in zip(read_tables, READ_TABLES, strict=True):
                if getattr(plan, name) is not None:
                    host[: plan.reads.numel()] = getattr(plan, name)
        cos, sin = rope_rows(self.config, positions, torch.float32)
        for static, host in (
            (bucket.rows, rows),
            (bucket.segs, segs),
            (bucket.conv_src, conv_src),
            (bucket.pieces, pieces),
            (bucket.qblocks, qblocks),
            (bucket.reads, reads),
            (bucket.rope, torch.stack([cos, sin], dim=1)),
            *((getattr(bucket, name), host) for name, host in zip(READ_TABLES, read_tables, strict=True)),
        ):
            static.copy_(host, non_blocking=True)

    def _pack(self, bucket: _Bucket) -> None:
        """Move the bucket's int64 tables (PACKED_TABLES) into one device buffer, views of which
        they become (before anything reads them: a bucket is packed when it is made), with a host
        twin: a pass's tables then go up in one copy (`_load_packed`)."""
        dev = self.device
        shapes = {name: getattr(bucket, name).shape for name, _ in PACKED_TABLES if name != "positions"}
        shapes["positions"] = torch.Size([bucket.tokens])
        total = sum(shape.numel() for shape in shapes.values())
        device = torch.zeros(total, dtype=torch.int64, device=dev)
        host = torch.zeros(total, dtype=torch.int64, pin_memory=True) if dev.type == "cuda" else device
        host_np = host.numpy()
        views, at = {}, 0
        for name, shape in shapes.items():
            size = shape.numel()
            views[name] = host_np[at : at + size].reshape(shape)
            table = device[at : at + size].view(shape)
            if name != "positions":
                setattr(bucket, name, table)
            else:
                positions = table
            at += size
        bucket.staging = _Staging(host, device, views, positions, dict.fromkeys(shapes, 0))

    def _load_packed(self, bucket: _Bucket, plan: _Plan | None) -> None:
        """The plan's tables into the host buffer (zeroing only what the last load filled past
        them), one upload, and the RoPE rows gathered on the device from `rope_table`.

        Host cost (before every pass, nothing overlapping it): a table's leading part is written
        through a slice along its axis (not a `np.moveaxis` view of each side), a table neither
        filled now nor last time is skipped, and the upload's event is made once per bucket and
        recorded again (it was synchronized on above, so the previous record is complete)."""
        st = bucket.staging
        assert st is not None
        if st.copied is not None:
            st.copied.synchronize()  # the previous upload has read the host buffer (done unless back to back)
        for name, axis in PACKED_TABLES:
            new = None if plan is None else getattr(plan, name)
            n = 0 if new is None else new.shape[axis]
            used = st.used[name]
            if not (n or used):
                continue
            host = st.host_views[name]
            lead = _LEADING[axis]
            if used > n:
                host[(*lead, slice(n, used))] = 0
            if n:
                host[(*lead, slice(0, n))] = new.numpy()
            st.used[name] = n
        if st.device is not st.host:
            st.device.copy_(st.host, non_blocking=True)
            if st.copied is None:
                st.copied = torch.cuda.Event()
            st.copied.record()
        if plan is None or not plan.positions.numel():
            need = 1
        elif plan.positions_end is not None:
            need = plan.positions_end
        else:
            need = int(plan.positions.numpy().max()) + 1
        table = self._rope_rows
        if table is None or table.shape[0] < need:
            # rope_table's rows never change (a larger table replaces it): keep the last one
            table = self._rope_rows = rope_table(self.config, need, self.device)
        torch.index_select(table, 0, st.positions, out=bucket.rope)

    def _execute(self, plan: _Plan, tokens: int, slots: int) -> torch.Tensor:
        bucket, capturable = self._bucket(tokens, slots, plan.pieces.shape[2], plan.levels)
        logits, captured = self._graphs.run(
            bucket,
            self._forward,
            lambda: self._load(bucket, plan),
            lambda: self._load(bucket, None),
            capturable=capturable,
        )
        if captured:
            log.info(
                "body_graph_captured",
                tokens=bucket.tokens,
                slots=bucket.slots,
                pieces=bucket.pieces_per_segment,
                levels=bucket.levels,
            )
        self.passes += 1
        out = logits[: plan.reads.numel()].clone()
        if bucket.read_out is not None:
            attach(out, bucket.read_out.issue())
        return out

    # ------------------------------------------------------------------------------ the pass
    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        """The layer stack (`engine.run.layers`) at the read rows: logits fp32 [S, vocab] (and the
        read-outs' numbers, where the bucket makes them)."""
        logits = self._stack(bucket.rows[:, ROW_TOKEN], bucket, bucket.reads)
        if bucket.read_out is not None:
            bucket.read_out.compute(logits)
        return logits

    def _gdn(self, j: int, layer: dict, x: GdnInputs, bucket: _Bucket) -> torch.Tensor:
        c, (qkv, b_raw, a_raw) = self.config, x
        conv = forest_conv(
            qkv, layer["ssm_conv1d"], self.base, bucket.rows, bucket.segs, bucket.conv_src, j * self.tail_size
        )
        heads, chunked = self.gdn_heads, dict(chunk=self.gdn_chunk, dots=self.gdn_dots)
        prep = None
        if self.gdn_chunk:  # the state-free chunk products of every level at once
            prep = forest_gdn_prep(
                conv, b_raw, a_raw, layer["ssm_a"], layer["ssm_dt"], bucket.segs, bucket.qblocks,
                **heads, **chunked, prep_form=self.gdn_prep,
            )  # fmt: skip
        # the split chunk-64 form writes every row of o (padding rows: zeros, in the outputs
        # launch), so o needs no memset there (200 MB at 8,192 rows and the 27B heads)
        shape = (qkv.shape[0], c.linear_num_value_heads, c.linear_value_head_dim)
        o = (
            torch.empty(shape, device=qkv.device)
            if writes_padding_zeros(prep)
            else torch.zeros(shape, device=qkv.device)
        )
        for level in range(bucket.levels):
            forest_gdn(
                conv, b_raw, a_raw, layer["ssm_a"], layer["ssm_dt"], self.base, bucket.segs, level,
                j * self.state_size, o, **heads, **chunked, prep=prep, outputs=False,
            )  # fmt: skip
        # chunk 64 (split walk): every level's outputs at once, and the padding rows' zeros
        forest_gdn_outputs(prep, bucket.segs, o, rows=bucket.rows)
        return o

    def _attend_reads(
        self, pieces: torch.Tensor, layer: dict, x: AttentionInputs, bucket: _Bucket
    ) -> torch.Tensor:
        """The last attention layer at the read rows: every live row's key and value stored
        (`part="keys"`, the full prep's bits), the read rows' queries (`part="queries"` over the
        read slots' rows, RoPE at their positions), then each read row attended by the decode
        kernel over its segment's pieces (the read tables, `_read_tables`): [S, heads * dim]."""
        heads, hd = self.attention_heads, self.config.head_dim
        prep = PrepInputs(*x, layer["attn_q_norm"], layer["attn_k_norm"], bucket.rope)
        forest_attention_prep(prep, self.base, bucket.rows, bucket.segs, pieces, heads, part="keys")
        at_reads = prep._replace(rope=bucket.rope.index_select(0, bucket.reads))
        q = forest_attention_prep(
            at_reads, self.base, bucket.read_rows, bucket.segs, pieces, heads, part="queries"
        )
        return decode_attention(
            q, x.qg, self.base, bucket.read_decode, bucket.read_pieces, num_kv_heads=self.config.num_kv_heads,
            splits=self.read_splits, dots=self.attention_dots, num_warps=attention_warps(hd),
        )  # fmt: skip

    def _attend(self, pieces: torch.Tensor, layer: dict, x: AttentionInputs, bucket: _Bucket) -> torch.Tensor:
        prep = PrepInputs(*x, layer["attn_q_norm"], layer["attn_k_norm"], bucket.rope)
        bf16 = self.attention_dots == "bf16" and forest_attention_module.QUERIES_BF16
        # bf16 queries with the FMHA tier's padding rows wherever it may run: it reads them in place
        pad = (
            forest_attention_module.FMHA_PAD
            if bf16 and forest_attention_module.FMHA_LONG_TIER is not False
            else 0
        )
        q = forest_attention_prep(
            prep, self.base, bucket.rows, bucket.segs, pieces, self.attention_heads,
            q_dtype=torch.bfloat16 if bf16 else torch.float32, pad_rows=pad,
        )  # fmt: skip
        return forest_attention(
            q, x.qg, self.base, bucket.rows, bucket.segs, pieces, bucket.qblocks,
            num_kv_heads=self.config.num_kv_heads, dots=self.attention_dots,
        )  # fmt: skip
