"""Where image tokens sit in the prompt, and the text model's three-axis rotary positions for them.

Rendering: the GGUF's chat template turns a user message whose content is `[image, ..., text]`
into `<|vision_start|><|image_pad|><|vision_end|>` per image followed by the text, and the
processor repeats `<|image_pad|>` once per merged patch. Prism puts a request's images first in
the user message, in the order given, so the evidence segment is

    (<|vision_start|> <|image_pad|> x tokens(image) <|vision_end|>) per image, "Evidence:\\n{state}\\n\\n"

and the system prefix before it is unchanged (shared by every request, with or without images).
The image tokens are special tokens, so the evidence text after them tokenizes as it does alone.

Positions (transformers' `get_rope_index` for Qwen3.5): text tokens advance one position on all
three axes (time, height, width); an image's pad tokens, laid out row by row over its merged
grid (gh x gw), take time = p, height = p + row, width = p + column, where p is the position
the image starts at, and the text after it continues at p + max(gh, gw). So a segment's tokens
and its rope positions no longer advance together: `SegmentImages.span` says where the next
segment's positions start, relative to this segment's start.

The rotary angles are interleaved over the axes (Qwen3.5's `mrope_interleaved`): frequency j
turns with the height position when j % 3 == 1 and j < 3 * sections[1], with the width when
j % 3 == 2 and j < 3 * sections[2], else with time. Text tokens have equal axes, so their angles
are exactly those of plain RoPE (`engine.run.rope.rope_rows`), which every angle here is taken from:
a position's values stay a function of the position alone, whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig
from engine.run.rope import rope_rows

VISION_START = "<|vision_start|>"
IMAGE_PAD = "<|image_pad|>"
VISION_END = "<|vision_end|>"


@dataclass(frozen=True)
class SegmentImages:
    """The image content of one forest segment.

    embeds: [pads, hidden] the tower's output for every image pad token, in token order.
    index: [pads] int64, the segment-local index of each pad token.
    offsets: [3, tokens] int64 rope positions (time, height, width) relative to the segment start.
    span: rope position of the token after this segment, relative to the segment start.
    digests: the images' digests, in order (the prefix cache's image key).
    """

    embeds: torch.Tensor
    index: torch.Tensor
    offsets: torch.Tensor
    span: int
    digests: tuple[str, ...]

    def shift(self, length: int) -> int:
        """How far the next position is from `start + length` (negative for images: grids are 2-D)."""
        return self.span - length


def image_token_block(pad_count: int, vision_start: int, image_pad: int, vision_end: int) -> list[int]:
    """The tokens of one image in the prompt."""
    return [vision_start] + [image_pad] * pad_count + [vision_end]


def rope_offsets(
    tokens: Sequence[int], image_pad: int, grids: Sequence[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(offsets [3, T], pad index [pads], span) of a token sequence holding len(grids) images.

    Each maximal run of pad tokens is one image, of grids[k] = (gh, gw) merged tokens; a run of
    another length than gh * gw is a ValueError (the evidence and the images disagree)."""
    offsets = torch.empty(3, len(tokens), dtype=torch.int64)
    pads: list[int] = []
    cur, i, k = 0, 0, 0
    n = len(tokens)
    while i < n:
        if tokens[i] != image_pad:
            offsets[:, i] = cur
            cur += 1
            i += 1
            continue
        j = i
        while j < n and tokens[j] == image_pad:
            j += 1
        if k >= len(grids):
            raise ValueError(f"the tokens hold more image runs than the {len(grids)} images given")
        gh, gw = grids[k]
        if j - i != gh * gw:
            raise ValueError(f"image {k} has {j - i} pad tokens, its {gh}x{gw} grid needs {gh * gw}")
        rows = torch.arange(gh).repeat_interleave(gw)
        cols = torch.arange(gw).repeat(gh)
        offsets[0, i:j] = cur
        offsets[1, i:j] = cur + rows
        offsets[2, i:j] = cur + cols
        pads.extend(range(i, j))
        cur += max(gh, gw)
        k += 1
        i = j
    if k != len(grids):
        raise ValueError(f"the tokens hold {k} image runs, but {len(grids)} images were given")
    return offsets, torch.tensor(pads, dtype=torch.int64), cur


def axis_of_column(config: ModelConfig) -> torch.Tensor:
    """[rope_dims] which axis (0 time, 1 height, 2 width) each cos/sin column turns with."""
    half = config.rope_dims // 2
    sections = config.rope_sections
    axis = torch.zeros(half, dtype=torch.int64)
    for j in range(half):
        if j % 3 == 1 and j < 3 * sections[1]:
            axis[j] = 1
        elif j % 3 == 2 and j < 3 * sections[2]:
            axis[j] = 2
    return torch.cat([axis, axis])


def mrope_rows(
    config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope_dims] for positions [T] (text: plain RoPE) or [3, T] (time, height, width)."""
    if positions.dim() == 1:
        return rope_rows(config, positions, dtype)
    if positions.dim() != 2 or positions.shape[0] != 3:
        raise ValueError(f"positions must be [T] or [3, T], got shape {tuple(positions.shape)}")
    per_axis = [rope_rows(config, positions[a], dtype) for a in range(3)]
    pick = axis_of_column(config)
    cos = torch.stack([c for c, _ in per_axis])  # [3, T, rd]
    sin = torch.stack([s for _, s in per_axis])
    cols = torch.arange(config.rope_dims)
    return cos[pick, :, cols].T.contiguous(), sin[pick, :, cols].T.contiguous()
