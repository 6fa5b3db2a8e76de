"""Test images: random ones of any size, mode and format, and hostile ones (test helpers only).

Random images are noise plus smooth gradients (noise alone makes every resize filter look the
same; gradients alone hide patch-order mistakes). Hostile images are built byte by byte so they
are exactly what they claim: a PNG whose header says 30,000 x 30,000, a PNG whose few kilobytes
inflate to gigabytes (a zip bomb), a truncated file.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def random_image(height: int, width: int, *, fmt: str = "PNG", mode: str = "RGB", seed: int = 0) -> bytes:
    """Encoded bytes of a random `mode` image (RGB, RGBA, L, LA, P, PA...) in `fmt` (PNG, JPEG, WEBP)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack(
        [(xx * 255 // max(width - 1, 1)), (yy * 255 // max(height - 1, 1)), ((xx + yy) * 7) % 256], axis=-1
    )
    noise = rng.integers(-40, 41, (height, width, 3))
    rgb = np.clip(base + noise, 0, 255).astype(np.uint8)
    img = Image.fromarray(rgb, "RGB")
    if mode in ("RGBA", "LA", "PA"):
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L")
        img = img.convert("RGBA")
        img.putalpha(alpha)
    if mode != img.mode:
        img = img.convert(mode)
    out = io.BytesIO()
    if mode == "P" and fmt == "PNG":
        img.info["transparency"] = 0  # palette entry 0 transparent: the tRNS path
        img.save(out, format=fmt, transparency=0)
    else:
        img.save(out, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _chunk(kind: bytes, body: bytes) -> bytes:
    return (
        struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    )


def png_with_header(width: int, height: int, idat: bytes = b"") -> bytes:
    """A PNG of RGB8 `width x height` whose IDAT holds `idat` (raw, already compressed)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def huge_header_png(side: int = 30_000) -> bytes:
    """A small file whose header claims `side x side` pixels (its data is one empty row)."""
    return png_with_header(side, side, zlib.compress(b"\x00" * (1 + 3 * 16)))


def zip_bomb_png(side: int = 7_000) -> bytes:
    """A valid PNG of `side x side` black pixels: ~150 MB of pixels in ~150 kB (zlib's ~1000:1)."""
    row = b"\x00" * (1 + 3 * side)
    z = zlib.compressobj(9)
    parts = [z.compress(row) for _ in range(side)]
    parts.append(z.flush())
    return png_with_header(side, side, b"".join(parts))


def truncated(data: bytes, keep: float = 0.5) -> bytes:
    """The first `keep` fraction of an encoded image."""
    return data[: max(1, int(len(data) * keep))]
