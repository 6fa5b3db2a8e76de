"""Thought decoding on the int8 path: one-token steps for many sequences, one CUDA graph per bucket.

`engine.thoughts.think` on CUDA hands every thinking question's prompt state (a `SegmentState` chain:
system root, evidence, question + `<think>\\n`) to a `Decoder`, which then advances all of them
one token per `step`:

- Rows: a step runs B rows, B the smallest bucket (1, 2, 4, ... 128) that holds the live
  sequences; the rest are padding rows that read and write nothing.
- Gated DeltaNet: each sequence owns a copy of its recurrent states [n_gdn, nv, dk, dv] and
  conv tails [n_gdn, C, 3], updated in place by the step kernels (`engine.kernels.decode_gdn`).
- Attention: each sequence owns thought K/V buffers [n_attn, nkv, capacity, hd] that grow in
  place (doubling, up to the thought budget plus the closing tokens); ancestor K/V are read
  where they lie, through a device-side piece table of offsets (`engine.kernels.decode_rows`,
  `engine.kernels.decode_attention`): the shared system and evidence K/V are never copied.
- Attention products: fp32 ("ieee") or, as the one-pass body's `attention_dots`, bf16 / tf32
  tensor-core dots (the engine hands the decoder its body's setting: the CUDA default's bf16).
- Linears: the int8 path's own arithmetic (`engine.quant.linear`): per-row int8 activations (fused
  with the preceding RMSNorm / SwiGLU / gated norm where there is one), exact int32 products,
  the fixed fp32 epilogue, residual adds fused into the GEMM epilogue.

On CUDA the whole step - embedding, layers, final norm, LM head - is captured once per bucket
as a `torch.cuda.CUDAGraph` and replayed; the step's inputs (row table, piece tables, RoPE
cos/sin, each row's uniform for its next draw) are copied into that bucket's static tensors first;
the graph ends with the thought sampler's draw (`engine.kernels.draw.StepDraw`), whose tokens a
next step can be fed on the device (`step`'s None tokens). `graphs=False` runs the same
kernels eagerly (the graph's oracle), and on CPU the Triton kernels run in the interpreter
(tests). Every float op of a row runs in programs that see only that row, with configs fixed
by the model's sizes, so a row's logits are bitwise the same in any bucket, any slot, beside
any other sequences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog
import torch

from engine.kernels.attached import attach
from engine.kernels.decode_attention import PrepInputs, attention_prep, decode_attention
from engine.kernels.decode_gdn import CONV_WIDTH, conv_step, gdn_step
from engine.kernels.decode_rows import (
    CONV_OFF,
    LIVE,
    PIECE_FIELDS,
    ROW_FIELDS,
    STATE_OFF,
    THOUGHT_LEN,
    TOKEN,
    element_offset,
)
from engine.kernels.draw import DrawSettings, StepDraw
from engine.kernels.top_k import StepTopK, fits
from engine.model.weights import Weights
from engine.run.forest import SegmentState
from engine.run.graphs import fit
from engine.run.layers import AttentionInputs, GdnInputs, Int8Layers
from engine.run.rope import rope_rows

log = structlog.get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Whether buckets make the thought sampler's top-k numbers inside the step (`Decoder.sample_with`,
# `engine.kernels.top_k.StepTopK`): the same numbers, so the same tokens, without ~ten launches
# and a copy after every step. Built on the CPU (session 22), not yet timed on a GPU: off until
# `bench_engine.py --variants tc64inv,tc64inv-steptopk --decode-only` says it pays.
TOP_K_IN_STEP = False
# Whether buckets also draw each thought's next token inside the step (`engine.kernels.draw.StepDraw`:
# the top-k as `row_top_k`'s kernels, then the float64 draw, the host reading one token a row): the
# same tokens, without the top-k launches after the replay and the host's draw. On since session 32
# (H100, 27B, `STAGE=draw bash ops/device/candidates_check.sh`: 64 sequences 2,607-2,642 -> 2,865
# tokens/s, one sequence 87.6-90.1 -> 91.4; ops/bench/RESULTS.md). It replaces TOP_K_IN_STEP's
# numbers (a bucket makes one or the other); the bench's "tc64inv-hostdraw" times it off.
DRAW_IN_STEP = True
MAX_PIECES = 4  # system root, evidence, question, own thought
FIRST_CAPACITY = 64  # thought K/V rows allocated at start; buffers double up to the capacity


@dataclass(eq=False)
class DecodeSequence:
    """One thought being decoded: its own state and buffers, and the prompt chain it reads."""

    chain: list[SegmentState]  # ancestors, oldest first (kept alive: the piece table points into them)
    position: int  # absolute position of the next token
    capacity: int  # most tokens this sequence may be fed
    recurrent: torch.Tensor  # [n_gdn, nv, dk, dv] fp32, updated in place
    conv: torch.Tensor  # [n_gdn, C, 3] fp32, updated in place
    keys: torch.Tensor  # [n_attn, nkv, allocated, hd] fp32: the thought's own K
    values: torch.Tensor  # [n_attn, nkv, allocated, hd]
    pieces: torch.Tensor  # [n_attn, P, 4] int64 (host): this sequence's rows of the piece tables
    state_off: int = 0  # element offsets of recurrent and conv from the decoder's base (fixed)
    conv_off: int = 0
    length: int = 0  # tokens fed so far (rows used in keys/values)
    version: int = 0  # bumped whenever the piece table changes (buffer growth)
    drawn_at: tuple[int, int] | None = None  # (launch, row) of the step that last drew its next token
    held: list[torch.Tensor] = field(default_factory=list)  # contiguous copies the table points at

    @property
    def allocated(self) -> int:
        return int(self.keys.shape[2])


@dataclass(eq=False)
class _Bucket:
    """Static inputs (and, on CUDA, the captured graph) of one bucket size."""

    size: int
    rows: torch.Tensor  # [B, ROW_FIELDS] int64
    rope: torch.Tensor  # [B, 2, rope_dims] fp32 (cos, sin)
    pieces: torch.Tensor  # [n_attn, B, P, 4] int64
    source: torch.Tensor  # [B] int64: the row of the last launch's draws a row is fed (-1: its TOKEN)
    logits: torch.Tensor | None = None  # the graph's output
    graph: torch.cuda.CUDAGraph | None = None
    top_k: StepTopK | None = None  # the sampler's numbers made in the step (`Decoder.sample_with`)
    draw: StepDraw | None = None  # the sampler's tokens drawn in the step (`Decoder.sample_with`)
    members: tuple | None = None  # (id, version) of the sequences whose pieces are loaded
    held: list[DecodeSequence] = field(default_factory=list)


class Decoder(Int8Layers):
    """One-token decode steps for the int8 weights on one device (see the module docstring)."""

    def __init__(
        self,
        weights: Weights,
        *,
        graphs: bool | None = None,
        buckets: tuple[int, ...] = BUCKETS,
        max_pieces: int = MAX_PIECES,
        attention_dots: str = "ieee",
    ) -> None:
        self._bind(weights, graphs, "decoder")
        if attention_dots not in ("ieee", "tf32", "bf16"):
            raise ValueError(f"attention_dots must be ieee, tf32 or bf16, got {attention_dots!r}")
        self.attention_dots = attention_dots  # the body's setting (engine.run.path.CUDA_BODY_SETTINGS)
        self.buckets = tuple(sorted(buckets))
        self.max_pieces = max_pieces
        c = self.config
        if c.conv_kernel != CONV_WIDTH:
            raise ValueError(f"the conv step kernel is written for width {CONV_WIDTH}, got {c.conv_kernel}")
        # every offset in the tables is relative to this tensor; padding rows point into it
        self.base = torch.zeros(64, dtype=torch.float32, device=self.device)
        self._pad = self._new_sequence([], 0, 1)
        self._bucket_cache: dict[int, _Bucket] = {}
        self._sampler: DrawSettings | None = None
        # the last launch's drawn tokens, one a row: a step can feed a sequence the token its
        # previous step drew without the host reading it first (`step`'s None tokens)
        self._feed = torch.zeros(self.buckets[-1], dtype=torch.int64, device=self.device)
        self.steps = 0  # launches so far (a sequence's `drawn_at` names one)

    def sample_with(self, settings: DrawSettings | None) -> None:
        """From now on, buckets made (and captured) also do the thought sampler's device part with
        these settings inside each step: its tokens where DRAW_IN_STEP is on (`StepDraw`, with the
        uniforms `step` is given) and the settings allow it (temperature > 0, a k `row_top_k`
        takes), else its top-k numbers where TOP_K_IN_STEP is on (`StepTopK`); the same tokens or
        numbers the sampler would make after the step, without its launches. None: neither. Set it
        before the first step (`engine.thoughts.DecoderSteps` does, from the decision config).
        Other settings than before drop the buckets (their graphs draw with the old ones: a step fed
        its own draw must draw what the sampler would)."""
        if settings is not None and settings.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {settings}")
        if settings != self._sampler:
            self._bucket_cache.clear()
        self._sampler = settings

    def draws_in_step(self) -> bool:
        """Whether buckets made from now on draw the sampler's tokens in the step (DRAW_IN_STEP on
        and `sample_with`'s settings allow it): then `step` takes None tokens."""
        s = self._sampler
        return bool(s and DRAW_IN_STEP and s.temperature > 0.0 and fits(self.config.vocab_size, s.top_k))

    # ------------------------------------------------------------------------------ sequences
    def start(self, state: SegmentState, capacity: int) -> DecodeSequence:
        """A sequence continuing `state` (its chain is read, never modified) for up to `capacity` tokens."""
        chain = state.chain()
        if len(chain) > self.max_pieces - 1:
            raise ValueError(f"a chain of {len(chain)} segments exceeds the decoder's {self.max_pieces - 1}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        return self._new_sequence(chain, state.end, capacity)

    def _new_sequence(self, chain: list[SegmentState], position: int, capacity: int) -> DecodeSequence:
        c, dev = self.config, self.device
        nv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        last = chain[-1] if chain else None
        if last is not None:
            recurrent = torch.stack([last.recurrent[i].to(dev, torch.float32) for i in self.gdn_layers])
            conv = torch.stack([last.conv[i].to(dev, torch.float32) for i in self.gdn_layers])
        else:
            recurrent = torch.zeros(len(self.gdn_layers), nv, dk, dv, device=dev)
            conv = torch.zeros(len(self.gdn_layers), c.conv_dim, c.conv_kernel - 1, device=dev)
        allocated = min(capacity, FIRST_CAPACITY)
        shape = (len(self.attn_layers), c.num_kv_heads, allocated, c.head_dim)
        seq = DecodeSequence(
            chain=chain,
            position=position,
            capacity=capacity,
            recurrent=recurrent.contiguous(),
            conv=conv.contiguous(),
            keys=torch.zeros(shape, device=dev),
            values=torch.zeros(shape, device=dev),
            pieces=torch.zeros(len(self.attn_layers), self.max_pieces, PIECE_FIELDS, dtype=torch.int64),
        )
        seq.state_off, seq.conv_off = self._offset(seq.recurrent), self._offset(seq.conv)
        for a, i in enumerate(self.attn_layers):
            for p, node in enumerate(chain):
                k, v = self._readable(node.keys[i], seq), self._readable(node.values[i], seq)
                n = int(k.shape[1])
                seq.pieces[a, p] = torch.tensor([self._offset(k), self._offset(v), n, n])
        self._point_own(seq)
        return seq

    def _readable(self, t: torch.Tensor, seq: DecodeSequence) -> torch.Tensor:
        """t as contiguous fp32 on the device (a copy held by seq only when it is not already)."""
        if t.device == self.device and t.dtype == torch.float32 and t.is_contiguous():
            return t
        copy = t.to(self.device, torch.float32).contiguous()
        seq.held.append(copy)
        return copy

    def _offset(self, t: torch.Tensor) -> int:
        return element_offset(t, self.base)

    def _point_own(self, seq: DecodeSequence) -> None:
        for a in range(len(self.attn_layers)):
            seq.pieces[a, -1] = torch.tensor(
                [self._offset(seq.keys[a]), self._offset(seq.values[a]), 0, seq.allocated]
            )
        seq.version += 1

    def _make_room(self, seq: DecodeSequence) -> None:
        """Double the thought buffers (up to the capacity) when the next token would not fit."""
        if seq.length < seq.allocated:
            return
        if seq.length >= seq.capacity:
            raise ValueError(f"sequence is full: {seq.length} tokens fed, capacity {seq.capacity}")
        grown = min(seq.capacity, 2 * seq.allocated)
        for name in ("keys", "values"):
            old = getattr(seq, name)
            new = torch.zeros(*old.shape[:2], grown, old.shape[3], device=self.device)
            new[:, :, : seq.length] = old[:, :, : seq.length]
            setattr(seq, name, new)
        self._point_own(seq)

    def sequence_bytes(self, capacity: int) -> int:
        """Device bytes one sequence holds at most: GDN states, conv tails, full thought buffers."""
        c = self.config
        gdn = len(self.gdn_layers) * (
            c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
            + c.conv_dim * (c.conv_kernel - 1)
        )
        kv = 2 * len(self.attn_layers) * c.num_kv_heads * capacity * c.head_dim
        return 4 * (gdn + kv)

    def max_live(self, capacity: int, memory_fraction: float = 0.5) -> int:
        """How many sequences of `capacity` tokens to keep live at once: the largest bucket, or
        fewer when their buffers would take more than `memory_fraction` of the free device memory."""
        top = self.buckets[-1]
        if self.device.type != "cuda":
            return top
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(1, min(top, int(memory_fraction * free) // max(1, self.sequence_bytes(capacity))))

    # ------------------------------------------------------------------------------ steps
    def step(
        self,
        seqs: list[DecodeSequence],
        tokens: Sequence[int | None],
        uniforms: Sequence[float | None] | None = None,
    ) -> torch.Tensor:
        """Feed tokens[j] to seqs[j]; return the next-token logits fp32 [len(seqs), vocab] (a copy).

        uniforms[j]: the uniform of seqs[j]'s next draw (None: it draws none), for buckets that
        draw in the step (`sample_with`); the logits then carry those tokens for the sampler.
        tokens[j] None: feed seqs[j] the token the previous launch drew for it, read on the device
        (that launch must have drawn one for it: a uniform, a bucket that draws), so the host can
        queue this step before it has read that token. More sequences than the largest bucket run
        in several bucket-sized steps (a row's result does not depend on which); None tokens need
        one.
        """
        if len(seqs) != len(tokens) or (uniforms is not None and len(uniforms) != len(seqs)):
            count = "no" if uniforms is None else len(uniforms)
            raise ValueError(f"{len(seqs)} sequences but {len(tokens)} tokens and {count} uniforms")
        if len(set(map(id, seqs))) != len(seqs):
            raise ValueError("a sequence appears twice in one step")
        us: Sequence[float | None] = [None] * len(seqs) if uniforms is None else uniforms
        top = self.buckets[-1]
        for seq, token in zip(seqs, tokens, strict=True):
            if token is None and (seq.drawn_at is None or seq.drawn_at[0] != self.steps or len(seqs) > top):
                raise ValueError(
                    "a None token feeds the token the previous launch drew for the sequence, in one "
                    "bucket: that launch drew none for this one"
                )
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            parts = [
                self._step(seqs[i : i + top], tokens[i : i + top], us[i : i + top])
                for i in range(0, len(seqs), top)
            ]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts)  # (the parts' draws stay with the parts: the sampler draws these rows)

    def forget(self) -> None:
        """Drop the buckets' references to the last sequences they ran (their states and chains),
        so finished thoughts free their memory; the next step reloads its tables."""
        for bucket in self._bucket_cache.values():
            bucket.members, bucket.held = None, []

    def _step(
        self, seqs: list[DecodeSequence], tokens: Sequence[int | None], uniforms: Sequence[float | None]
    ) -> torch.Tensor:
        n = len(seqs)
        if n == 0:
            return torch.zeros(0, self.config.vocab_size, device=self.device)
        for seq in seqs:
            self._make_room(seq)
        size, ok = fit(n, self.buckets)
        if not ok:
            raise ValueError(f"{n} sequences in one step: more than the largest bucket, {self.buckets[-1]}")
        bucket = self._bucket(size)
        # a capture's warm-up run draws into the feed: the previous launch's draws are put back
        kept = self._feed.clone() if self._graphs.enabled and bucket.graph is None else None

        def load() -> None:
            if kept is not None:
                self._feed.copy_(kept)
            self._load(bucket, seqs, tokens, uniforms)

        logits, captured = self._graphs.run(bucket, self._forward, load, lambda: self._load_padding(bucket))
        if captured:
            log.info("decode_graph_captured", bucket=bucket.size)
        self.steps += 1
        draws = bucket.draw is not None
        for r, (seq, u) in enumerate(zip(seqs, uniforms, strict=True)):
            seq.length += 1
            seq.position += 1
            seq.drawn_at = (self.steps, r) if draws and u is not None else None
        out = logits[:n].clone()
        if bucket.top_k is not None:
            attach(out, bucket.top_k.issue())
        if bucket.draw is not None:
            attach(out, bucket.draw.issue())
        return out

    def _bucket(self, size: int) -> _Bucket:
        if size not in self._bucket_cache:
            c, dev, sampler = self.config, self.device, self._sampler
            draw = StepDraw(size, sampler, self._feed) if sampler and self.draws_in_step() else None
            self._bucket_cache[size] = _Bucket(
                size=size,
                rows=torch.zeros(size, ROW_FIELDS, dtype=torch.int64, device=dev),
                rope=torch.zeros(size, 2, c.rope_dims, device=dev),
                pieces=torch.zeros(
                    len(self.attn_layers), size, self.max_pieces, PIECE_FIELDS, dtype=torch.int64, device=dev
                ),
                source=torch.full((size,), -1, dtype=torch.int64, device=dev),
                top_k=StepTopK(size, sampler.top_k, dev) if sampler and TOP_K_IN_STEP and not draw else None,
                draw=draw,
            )
        return self._bucket_cache[size]

    def _load(
        self,
        bucket: _Bucket,
        seqs: list[DecodeSequence],
        tokens: Sequence[int | None],
        uniforms: Sequence[float | None] = (),
    ) -> None:
        """Write this step's inputs into the bucket's static tensors (a None token: the row of the
        previous launch's draws it is fed, in `source`)."""
        b, n = bucket.size, len(seqs)
        padded = seqs + [self._pad] * (b - n)
        members = tuple((id(s), s.version) for s in padded)
        if bucket.members != members:
            bucket.pieces.copy_(torch.stack([s.pieces for s in padded], dim=1), non_blocking=True)
            bucket.members, bucket.held = members, padded  # held: ids stay unique while loaded
        table = [[0] * ROW_FIELDS for _ in range(b)]  # one host tensor from lists: ~2 us a row
        for r, s in enumerate(padded):
            table[r][STATE_OFF], table[r][CONV_OFF] = s.state_off, s.conv_off
        source = [-1] * b
        for r, (s, token) in enumerate(zip(seqs, tokens, strict=True)):
            if token is None:
                assert s.drawn_at is not None
                token, source[r] = 0, s.drawn_at[1]
            table[r][TOKEN], table[r][THOUGHT_LEN], table[r][LIVE] = token, s.length, 1
        rows = torch.tensor(table, dtype=torch.int64)
        positions = torch.tensor([s.position for s in seqs] + [0] * (b - n), dtype=torch.int64)
        cos, sin = rope_rows(self.config, positions, torch.float32)
        bucket.rows.copy_(rows, non_blocking=True)
        bucket.rope.copy_(torch.stack([cos, sin], dim=1), non_blocking=True)
        if bucket.draw is not None:
            bucket.draw.load(uniforms)
            bucket.source.copy_(torch.tensor(source, dtype=torch.int64), non_blocking=True)

    def _load_padding(self, bucket: _Bucket) -> None:
        """Every row a padding row: a step that reads and writes nothing (graph warm-up, capture)."""
        self._load(bucket, [], [])

    # ------------------------------------------------------------------------------ the step
    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        """The layer stack (`engine.run.layers`) for the bucket's rows: logits fp32 [B, vocab] (and
        the sampler's top-k numbers or tokens of them, where the bucket makes them)."""
        tokens = bucket.rows[:, TOKEN]
        if bucket.draw is not None:  # rows fed the previous launch's draw read it here (-1 -> 0: NaN rows)
            fed = self._feed[bucket.source.clamp(min=0)].clamp(min=0)
            tokens = torch.where(bucket.source >= 0, fed, tokens)
        logits = self._stack(tokens, bucket)
        if bucket.top_k is not None:
            bucket.top_k.compute(logits)
        if bucket.draw is not None:
            bucket.draw.compute(logits)
        return logits

    def _gdn(self, j: int, layer: dict, x: GdnInputs, bucket: _Bucket) -> torch.Tensor:
        conv = conv_step(x.qkv, layer["ssm_conv1d"], self.base, bucket.rows, j * self.tail_size)
        return gdn_step(
            conv, x.b_raw, x.a_raw, layer["ssm_a"], layer["ssm_dt"], self.base, bucket.rows,
            j * self.state_size, **self.gdn_heads,
        )  # fmt: skip

    def _attend(self, pieces: torch.Tensor, layer: dict, x: AttentionInputs, bucket: _Bucket) -> torch.Tensor:
        prep = PrepInputs(*x, layer["attn_q_norm"], layer["attn_k_norm"], bucket.rope)
        q = attention_prep(prep, self.base, bucket.rows, pieces, self.attention_heads)
        kv_heads = self.config.num_kv_heads
        return decode_attention(
            q, x.qg, self.base, bucket.rows, pieces, num_kv_heads=kv_heads, dots=self.attention_dots
        )
