"""A request's images inside one `Engine.decide` call: checked once, encoded at most once.

`ImageSet` holds the decoded bytes, digests and merged grids of a request's images. The grids
(and so the evidence tokens and the prefix-cache key) come from the checked header and size
alone; pixels are prepared and the tower runs only when the evidence segment is really
computed, so a prefix-cache hit skips both. `GridMemo` remembers which image bytes were
already checked (by digest) so that the token count the pipeline asks for before batching and
the decide call after it decode an image once each at most.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.model.tokenizer import Tokenizer
from engine.vision.mmproj import VisionWeights
from engine.vision.placement import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    SegmentImages,
    image_token_block,
    rope_offsets,
)
from engine.vision.preprocess import (
    ImageError,
    ImageLimits,
    image_digest,
    open_image,
    prepare_image,
    smart_resize,
)
from engine.vision.tower import encode_image


@dataclass(frozen=True)
class VisionTokens:
    """The three special tokens images are written with."""

    vision_start: int
    image_pad: int
    vision_end: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> VisionTokens:
        return cls(
            tokenizer.token_id(VISION_START), tokenizer.token_id(IMAGE_PAD), tokenizer.token_id(VISION_END)
        )


class GridMemo:
    """digest -> merged grid of images already checked; bounded, shared by the engine's threads."""

    def __init__(self, entries: int = 1024) -> None:
        self.entries = entries
        self._grids: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> tuple[int, int] | None:
        with self._lock:
            grid = self._grids.get(digest)
            if grid is not None:
                self._grids.move_to_end(digest)
            return grid

    def put(self, digest: str, grid: tuple[int, int]) -> None:
        with self._lock:
            self._grids[digest] = grid
            self._grids.move_to_end(digest)
            while len(self._grids) > self.entries:
                self._grids.popitem(last=False)


@dataclass
class ImageSet:
    """One request's images for one decide call."""

    datas: list[bytes]
    digests: tuple[str, ...]
    grids: list[tuple[int, int]]  # merged (llm) grid of each image
    _embeds: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def check(
        cls,
        datas: Sequence[bytes],
        vision: VisionWeights,
        limits: ImageLimits,
        max_pixels: int,
        memo: GridMemo,
    ) -> ImageSet:
        """Check every image (ImageError names the first bad one) and find its grid."""
        c = vision.config
        digests, grids = [], []
        for i, data in enumerate(datas):
            digest = image_digest(data)
            grid = memo.get(digest)
            if grid is None:
                try:
                    img = open_image(data, limits)
                    width, height = img.size
                    h, w = smart_resize(height, width, c.factor, c.min_pixels, max_pixels)
                except ImageError as e:
                    raise ImageError(f"image {i}: {e}") from None
                grid = (h // c.factor, w // c.factor)
                memo.put(digest, grid)
            digests.append(digest)
            grids.append(grid)
        return cls(list(datas), tuple(digests), grids)

    def tokens(self, ids: VisionTokens) -> list[int]:
        """The images' tokens, in order, as they open the evidence segment."""
        out: list[int] = []
        for gh, gw in self.grids:
            out += image_token_block(gh * gw, ids.vision_start, ids.image_pad, ids.vision_end)
        return out

    def embeddings(self, vision: VisionWeights, limits: ImageLimits, max_pixels: int) -> torch.Tensor:
        """[pads, hidden] every image through the tower, once per call (each image on its own)."""
        if self._embeds is None:
            parts = []
            for i, data in enumerate(self.datas):
                try:
                    prepared = prepare_image(data, vision.config, limits, max_pixels)
                except ImageError as e:
                    raise ImageError(f"image {i}: {e}") from None
                if prepared.llm_grid != self.grids[i]:
                    raise ImageError(f"image {i}: its grid changed between checking and encoding")
                parts.append(encode_image(vision, prepared))
            self._embeds = torch.cat(parts)
        return self._embeds

    def segment(
        self,
        tokens: Sequence[int],
        ids: VisionTokens,
        vision: VisionWeights,
        limits: ImageLimits,
        max_pixels: int,
    ) -> SegmentImages:
        """The `SegmentImages` of a segment whose tokens hold these images (evidence, or a whole prompt)."""
        offsets, index, span = rope_offsets(tokens, ids.image_pad, self.grids)
        embeds = self.embeddings(vision, limits, max_pixels)
        return SegmentImages(embeds=embeds, index=index, offsets=offsets, span=span, digests=self.digests)
