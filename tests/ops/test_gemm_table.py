"""ops/bench/gemm_table.py: sweep JSON -> the GEMM tables, on CPU from a SYNTHETIC sweep.

The timings below are made up; what is checked is the rule: per-M config by step-weighted
time, a shape's own best only past the margin, and `--merge` replacing only the swept buckets
of the shipped tables. Every swept candidate's name must also parse back to its config.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops" / "bench"))

import bench_kernels  # noqa: E402
import gemm_table  # noqa: E402

from engine.kernels.int8_gemm import GemmConfig  # noqa: E402

A, B, SK = "16x32x512/w4/s4", "64x128x128/w4/s4", "64x128x256/w4/s4/sk1"
TOP = 1 << 62


def _row(n: int, k: int, m: int, uses: int, times: dict[str, float]) -> dict:
    cands = {c: {"ms": t, "bit_equal": True} for c, t in times.items()}
    return {
        "model": "27B",
        "name": f"{n}x{k}",
        "n": n,
        "k": k,
        "m": m,
        "uses_per_step": uses,
        "candidates": cands,
        "best": min(times, key=times.get),
    }


def _sweep() -> dict:
    rows = [
        # wide shape: its own best at M = 16 is stream K by 7.5% (past a 5% margin)
        _row(34816, 5120, 16, 64, {A: 40.0, SK: 37.0}),
        _row(34816, 5120, 64, 64, {B: 50.0, SK: 40.0}),
        # narrow shape used twice (two +res linears): its own best at M = 64, B, is only 3%
        # faster than the per-M choice (within the margin)
        _row(5120, 6144, 16, 48, {A: 10.0, SK: 14.0}),
        _row(5120, 6144, 16, 16, {A: 10.0, SK: 14.0}),
        _row(5120, 6144, 64, 48, {B: 10.0, SK: 10.3}),
        _row(5120, 6144, 64, 16, {B: 10.0, SK: 10.3}),
    ]
    return {"rows": rows, "proposal": bench_kernels.propose(rows)}  # the sweep's own proposal


def test_per_m_choice_is_the_step_weighted_least() -> None:
    gemm = _sweep()
    # M = 16: A 64 * 40 + 64 * 10 = 3,200 < SK 64 * 37 + 64 * 14; M = 64: SK 64 * 40 + 64 * 10.3 < B
    assert gemm["proposal"]["per_m"] == {16: A, 64: SK}
    common, shapes = gemm_table.tables(gemm, 0.05)
    assert common == [(16, A), (TOP, SK)]
    assert shapes == {(34816, 5120): [(TOP, SK)]}  # the narrow shape equals CONFIG_TABLE


def test_merge_replaces_only_the_swept_buckets() -> None:
    gemv, split = "1x8x512/w2/s1/gemv", "16x64x256/w4/s4/split2"
    shipped = [(1, gemv), (4, split), (16, A), (384, B), (TOP, "C")]
    shape_tables = {
        (5120, 6144): [(1, "G4"), (16, A), (64, "64x64x256/w4/s4/split2"), (TOP, "C")],
        (2560, 9216): [(1, "G4"), (TOP, "C")],  # not swept: kept as it was
    }
    common, shapes = gemm_table.merged_tables(_sweep(), 0.05, shipped, shape_tables)
    # (4, 16] keeps A (swept, the same), (16, 64] becomes SK, (64, 384] keeps B
    assert common == [(1, gemv), (4, split), (16, A), (64, SK), (384, B), (TOP, "C")]
    assert shapes == {
        (5120, 6144): [(1, "G4"), (16, A), (64, SK), (TOP, "C")],  # its M = 64 bucket: the per-M config
        (2560, 9216): shape_tables[(2560, 9216)],
        (34816, 5120): [(1, gemv), (4, split), (64, SK), (384, B), (TOP, "C")],  # from CONFIG_TABLE
    }


def test_overlay_bucket_bounds() -> None:
    old = [(4, "x"), (TOP, "y")]
    assert gemm_table.overlay(old, {16: "z"}) == [(4, "x"), (16, "z"), (TOP, "y")]
    assert gemm_table.overlay(old, {2: "x", TOP: "y"}) == old
    assert gemm_table.overlay(old, {}) == old


def test_every_candidate_name_parses_back() -> None:
    every = (
        bench_kernels.DECODE_CANDIDATES
        + bench_kernels.M16_CANDIDATES
        + bench_kernels.M64_CANDIDATES
        + bench_kernels.PREFILL_CANDIDATES
    )
    for cfg in every:
        assert eval(gemm_table.config_source(str(cfg)), {"GemmConfig": GemmConfig}) == cfg
