"""Time the vision tower for one screenshot at Qwen3.5's real tower shape, on the engine's device.

Qwen3.5's tower is the same at every size (27 blocks of width 1152, 16 heads, MLP 4304, 16-pixel
patches merged 2x2); only the merger's output width follows the text model (2560 at 4B, 5120 at
27B). Random weights of those shapes (no files needed), one random 1,024 x 768 PNG, preprocessing
and the tower timed apart, medians over `--repeats` runs after a warm-up:

    python ops/bench/bench_vision.py --device cuda --shape 27B
    python ops/bench/bench_vision.py --device cpu --shape tiny --repeats 2   # a smoke run

Prints one JSON object (tokens, patches, preprocess_ms, tower_ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.engine import DEFAULT_MAX_IMAGE_PIXELS
from engine.testing.images import random_image
from engine.testing.make_model import DIMS, random_vision_weights, vision_config_for
from engine.vision.mmproj import VisionConfig
from engine.vision.preprocess import prepare_image
from engine.vision.tower import encode_image

TOWER = dict(
    hidden_size=1152, intermediate_size=4304, num_layers=27, num_heads=16, num_position_embeddings=2304
)
TEXT_WIDTH = {"4B": 2560, "9B": 4096, "27B": 5120}


def tower_config(shape: str) -> VisionConfig:
    """The tower at `shape` ("tiny": the test generator's), resizing to at most the engine's 2 MP."""
    if shape == "tiny":
        return vision_config_for(DIMS["tiny"], max_pixels=DEFAULT_MAX_IMAGE_PIXELS)
    return vision_config_for(
        DIMS["tiny"], out_hidden_size=TEXT_WIDTH[shape], max_pixels=DEFAULT_MAX_IMAGE_PIXELS, **TOWER
    )


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench(shape: str, device: str, height: int, width: int, repeats: int) -> dict:
    weights = random_vision_weights(tower_config(shape), 0).to(device)
    data = random_image(height, width, seed=0)
    prep, tower = [], []
    tokens = patches = 0
    for i in range(repeats + 1):  # the first run warms allocators and kernels up
        t0 = time.perf_counter()
        image = prepare_image(data, weights.config)
        t1 = time.perf_counter()
        embeds = encode_image(weights, image)
        _sync(device)
        t2 = time.perf_counter()
        tokens, patches = int(embeds.shape[0]), int(image.pixels.shape[0])
        if i:
            prep.append((t1 - t0) * 1e3)
            tower.append((t2 - t1) * 1e3)
    return {
        "shape": shape,
        "device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu",
        "image": f"{width}x{height}",
        "tokens": tokens,
        "patches": patches,
        "preprocess_ms": round(statistics.median(prep), 3),
        "tower_ms": round(statistics.median(tower), 3),
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="27B", choices=["tiny", *TEXT_WIDTH])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--height", type=int, default=768)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args(argv)
    result = bench(a.shape, a.device, a.height, a.width, a.repeats)
    print(json.dumps(result))  # the script's output: one JSON line
    return result


if __name__ == "__main__":
    main()
