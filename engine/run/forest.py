"""The packed forest: a batch of token segments, each branching from a parent's state.

A batch is a forest. Its roots are segments whose parent is a state computed earlier (the
system segment computed at startup, or an evidence segment of an earlier pass); the others
hang under segments of the same batch. Every segment is an independent sequence that starts
from its parent's final state: Gated DeltaNet layers continue from the parent's recurrent state
and conv tail, attention layers read every ancestor's K/V directly plus their own segment,
causally. Nothing is copied per question, and shared evidence runs once.

`Forest` packs the segments into flat token arrays with tables (offsets, parents, levels,
read positions); `run_forest` executes it level by level (`engine.run.executor`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.vision.placement import SegmentImages


@dataclass(eq=False)
class SegmentState:
    """What a segment leaves behind for its children.

    recurrent/conv: GDN state S and conv tail after the segment's last token.
    keys/values: the segment's *own* attention K/V per attention layer, [n_kv, length, head_dim]
    (its ancestors' K/V stay in their own SegmentState; children read the chain).
    start/end are rope positions: `end` is where a child's positions start. `shift` is non-zero
    only for a segment holding images, whose 2-D grids take fewer positions than tokens
    (`engine.vision.placement`).
    """

    parent: SegmentState | None
    start: int  # absolute position of the first token
    length: int
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    shift: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length + self.shift

    def chain(self) -> list[SegmentState]:
        """Ancestors and self, oldest first: the fixed order attention reduces them in."""
        out: list[SegmentState] = []
        node: SegmentState | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def nbytes(self) -> int:
        tensors = [*self.recurrent.values(), *self.conv.values(), *self.keys.values(), *self.values.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Segment:
    """One node of the forest before execution.

    parent: an index of an earlier segment of the same forest, or a SegmentState computed
    before (cached evidence, the system root), or None for a sequence start.
    read: whether the logits at the segment's last token are needed.
    images: the image embeddings and rope positions of a segment holding images (evidence only).
    """

    tokens: tuple[int, ...]
    parent: int | SegmentState | None
    read: bool = False
    images: SegmentImages | None = field(default=None, compare=False)  # tensors: compared by tokens

    @property
    def shift(self) -> int:
        return 0 if self.images is None else self.images.shift(len(self.tokens))


@dataclass
class Forest:
    """Segments packed into flat arrays plus the tables that describe the batch."""

    segments: list[Segment]
    tokens: torch.Tensor  # [N] int64, segments back to back in level order
    offsets: torch.Tensor  # [S+1] int64, segment s is tokens[offsets[s]:offsets[s+1]]
    parents: torch.Tensor  # [S] int64, index of the in-forest parent or -1
    levels: torch.Tensor  # [S] int64, 0 for segments whose parent is outside the forest
    starts: torch.Tensor  # [S] int64, rope position of each segment's first token
    read_segments: list[int]  # segments with a read position, in segment order
    read_positions: torch.Tensor  # [R] int64, flat index of each read segment's last token
    packed_index: dict[int, int]  # caller's segment index -> packed index

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_levels(self) -> int:
        return int(self.levels.numpy().max()) + 1 if len(self.segments) else 0  # numpy: ~1/3 of torch's

    def level_segments(self, level: int) -> list[int]:
        return [s for s in range(len(self.segments)) if int(self.levels[s]) == level]

    def tokens_per_level(self) -> list[int]:
        sizes = self.offsets[1:] - self.offsets[:-1]
        return [int(sizes[self.levels == lv].sum()) for lv in range(self.num_levels)]


def build_forest(segments: Sequence[Segment]) -> Forest:
    """Order segments by level (parents first) and pack them.

    Segment indices in the result follow the packed order; `Forest.segments[i]` keeps each
    segment's parent re-indexed accordingly. Raises ValueError on an empty segment, a parent
    index that is not an earlier segment, or a cycle.

    Host cost (this runs before every pass's tables): the tables are made as numpy arrays and
    wrapped with `torch.from_numpy` (`torch.tensor` of a Python list took ~37 us for a 256-token
    request on the dev CPU, the numpy form ~9 us), and a forest already in level order (the
    engine's: evidence, then its questions) keeps the caller's segments (frozen: the same values).
    """
    n = len(segments)
    level = [0] * n
    in_order = True  # levels never decrease in the caller's order: the packed order is the caller's
    for i, seg in enumerate(segments):
        if not seg.tokens:
            raise ValueError(f"segment {i} has no tokens: every segment needs at least one")
        if isinstance(seg.parent, int):
            if not 0 <= seg.parent < i:
                raise ValueError(f"segment {i} names parent {seg.parent}, which is not an earlier segment")
            level[i] = level[seg.parent] + 1
        if i and level[i] < level[i - 1]:
            in_order = False
    # stable: keeps caller order within a level
    order = range(n) if in_order else sorted(range(n), key=lambda i: (level[i], i))
    new_index = {old: new for new, old in enumerate(order)}

    packed: list[Segment]
    if in_order:  # every parent index stays what it is
        packed = list(segments)
    else:
        packed = []
        for old in order:
            seg = segments[old]
            parent = new_index[seg.parent] if isinstance(seg.parent, int) else seg.parent
            packed.append(Segment(seg.tokens, parent, seg.read, seg.images))

    lengths = [len(s.tokens) for s in packed]
    offsets = [0, *accumulate(lengths)]
    starts: list[int] = []
    for seg in packed:
        if isinstance(seg.parent, int):
            starts.append(starts[seg.parent] + lengths[seg.parent] + packed[seg.parent].shift)
        elif isinstance(seg.parent, SegmentState):
            starts.append(seg.parent.end)
        else:
            starts.append(0)
    read_segments = [i for i, s in enumerate(packed) if s.read]
    tokens = np.fromiter(chain.from_iterable(s.tokens for s in packed), dtype=np.int64, count=offsets[-1])
    return Forest(
        segments=packed,
        tokens=torch.from_numpy(tokens),
        offsets=_int64(offsets),
        parents=_int64([s.parent if isinstance(s.parent, int) else -1 for s in packed]),
        levels=_int64([level[old] for old in order]),
        starts=_int64(starts),
        read_segments=read_segments,
        read_positions=_int64([offsets[i + 1] - 1 for i in read_segments]),
        packed_index=new_index,
    )


def _int64(values: list[int]) -> torch.Tensor:
    """An int64 CPU tensor of `values` (through numpy: a third of `torch.tensor`'s time on a list)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))
