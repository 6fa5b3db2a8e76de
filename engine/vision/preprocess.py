"""Untrusted image bytes -> the patches the vision tower reads, as the model was trained.

The steps equal transformers' `Qwen2VLImageProcessorPil` (the processor Qwen3.5 ships with),
so the tower sees the same numbers it saw in training:

1. decode with pillow (PNG, JPEG, WebP only); transparency is composited onto white, then RGB;
2. resize with pillow's bicubic filter to the nearest multiple of `patch * merge` on each side,
   rescaled (aspect kept) so the pixel count lies within [min_pixels, max_pixels];
3. scale to [0, 1] (in float64, then float32) and normalize per channel with the file's mean/std;
4. cut into `patch x patch` squares in merge-block order (the 2x2 squares one merged token
   covers are consecutive), each repeated over the two time steps of the Conv3d kernel.

Hostile input never reaches the decoder's expensive part: the byte size is bounded, the format
is checked from the header, and the header's width x height is bounded before any pixel is
decoded (a 30,000 x 30,000 header or a PNG whose few kilobytes inflate to gigabytes is refused
there). Every failure is an `ImageError` whose message says what was wrong.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from engine.types import ImageError
from engine.vision.mmproj import VisionConfig

__all__ = [
    "ImageError",
    "ImageLimits",
    "PreparedImage",
    "open_image",
    "pixel_values",
    "prepare_image",
    "smart_resize",
]

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_ASPECT = 200  # transformers refuses more extreme aspect ratios
DEFAULT_MAX_IMAGE_BYTES = 8 * 1024 * 1024
# Decoded source pixels before resizing: 40 MP covers an 8K screenshot; decoding costs ~3 bytes each.
DEFAULT_MAX_SOURCE_PIXELS = 40_000_000


@dataclass(frozen=True)
class ImageLimits:
    """What one image may cost before it is refused."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_source_pixels: int = DEFAULT_MAX_SOURCE_PIXELS


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for the tower: patches [grid_h * grid_w, patch_dim] float32 and its grid."""

    digest: str  # sha256 of the original bytes: the prefix cache's image key
    pixels: torch.Tensor
    grid_h: int  # in patches
    grid_w: int
    merge: int

    @property
    def tokens(self) -> int:
        """Image pad tokens this image occupies in the prompt (merged patches)."""
        return self.grid_h * self.grid_w // (self.merge * self.merge)

    @property
    def llm_grid(self) -> tuple[int, int]:
        return self.grid_h // self.merge, self.grid_w // self.merge


def image_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, pixel count within bounds, aspect kept.

    The same arithmetic as transformers' Qwen2-VL `smart_resize` (Python's round-half-even
    included), so both pick the same grid for every size.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"aspect ratio {max(height, width) / min(height, width):.1f} is above {MAX_ASPECT}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def open_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Decode `data` into an RGB pillow image, or raise ImageError (never anything else)."""
    if not data:
        raise ImageError("image is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image has {len(data)} bytes, more than the limit {limits.max_bytes}")
    try:
        img = Image.open(io.BytesIO(data), formats=list(FORMATS))
        width, height = img.size
        if width < 1 or height < 1:
            raise ImageError(f"image header gives an empty size {width}x{height}")
        if width * height > limits.max_source_pixels:
            raise ImageError(
                f"image is {width}x{height} = {width * height} pixels, "
                f"more than the limit {limits.max_source_pixels}"
            )
        img.load()  # decodes now: truncated or corrupt data fails here, not later
        return _to_rgb(img)
    except ImageError:
        raise
    except UnidentifiedImageError:
        raise ImageError(f"not a {'/'.join(FORMATS)} image (unrecognized header)") from None
    except Image.DecompressionBombError as e:  # pillow's own bound, above ours: a header far too large
        raise ImageError(f"image is too large to decode safely: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever a broken file makes a decoder raise, it is bad input
        raise ImageError(f"corrupt or truncated image: {type(e).__name__}: {e}") from None


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white (what transformers' processor does)."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def pixel_values(
    img: Image.Image, config: VisionConfig, max_pixels: int | None = None
) -> tuple[np.ndarray, int, int]:
    """Patches [grid_h * grid_w, 3 * T * p * p] float32 of an RGB image, and the grid (in patches)."""
    width, height = img.size
    h, w = smart_resize(height, width, config.factor, config.min_pixels, max_pixels or config.max_pixels)
    resized = img.resize((w, h), resample=Image.Resampling.BICUBIC)
    chw = np.moveaxis(np.asarray(resized, dtype=np.uint8), -1, 0)
    scaled = (chw.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    normed = (scaled - mean) / std
    p, m, t = config.patch_size, config.spatial_merge_size, config.temporal_patch_size
    gh, gw = h // p, w // p
    # [C, H, W] -> [gh/m, gw/m, m, m, C, p, p]: merge blocks outermost, then the patch inside it
    blocks = normed.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    timed = np.repeat(blocks[:, :, :, :, :, None], t, axis=5)  # the still image at both time steps
    return np.ascontiguousarray(timed.reshape(gh * gw, 3 * t * p * p)), gh, gw


def prepare_image(
    data: bytes, config: VisionConfig, limits: ImageLimits = ImageLimits(), max_pixels: int | None = None
) -> PreparedImage:
    """Check, decode and preprocess one image's bytes (ImageError on anything unusable)."""
    img = open_image(data, limits)
    patches, gh, gw = pixel_values(img, config, max_pixels)
    return PreparedImage(
        digest=image_digest(data),
        pixels=torch.from_numpy(patches),
        grid_h=gh,
        grid_w=gw,
        merge=config.spatial_merge_size,
    )
