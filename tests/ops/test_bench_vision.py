"""ops/bench/bench_vision.py on CPU at the tiny shape: a 1,024 x 768 screenshot keeps its size under
the engine's 2 MP bound, so it is 32 x 24 merged tokens of 2 x 2 patches, and both stages are timed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "bench"))

import bench_vision  # noqa: E402


def test_bench_vision_smoke_run() -> None:
    result = bench_vision.main(["--shape", "tiny", "--device", "cpu", "--repeats", "1"])
    assert (result["tokens"], result["patches"]) == ((1024 // 32) * (768 // 32), (1024 // 16) * (768 // 16))
    assert result["preprocess_ms"] > 0 and result["tower_ms"] > 0 and result["image"] == "1024x768"


def test_real_tower_shape() -> None:
    c = bench_vision.tower_config("27B")
    assert (c.num_layers, c.hidden_size, c.num_heads, c.out_hidden_size) == (27, 1152, 16, 5120)
    assert c.grid_side == 48 and c.patch_size == 16 and c.spatial_merge_size == 2
