"""The int8 GEMM on Hopper through CUTLASS 3: TMA loads and warp-specialized wgmma, which the
Triton tiles do not reach (Triton 3.6 specializes warps only at 4 warps on sm_90).

Same contract as `int8_gemm`: y = (float(acc) * a_scale[m]) * w_scale[n] (+ residual), fp32,
acc the exact int32 sum, the epilogue in CUTLASS's visitor tree compiled without FMA contraction
(`cuda/int8_gemm_sm90.cuh`). So the bits equal the Triton kernel's and the torch reference's
whatever config serves a call; configs are chosen by M from a fixed table for speed only.

Why a separate, optional library: CUTLASS is C++ templates compiled by nvcc for sm_90a, which
neither CI nor every GPU host has. `make cutlass` (`ops/build_cutlass.py`) writes one translation
unit per config, compiles them in parallel and links one shared library under
`.cache/cutlass/<digest>/`, the digest taken over the header and the configs, so an edited header
is never served by a stale build; each compiled unit is kept by what went into it (`OBJECTS`), so
a build compiles only the units an edit changed. `int8_gemm` calls it through ctypes on an sm_90 GPU where the
table names a config and the library is built; otherwise the Triton kernel runs (same bits).
`PRISM_CUTLASS=0` turns it off; `PRISM_CUTLASS_LIB` points at a library built elsewhere. The
ctypes call is a plain kernel launch on torch's current stream, so CUDA graphs capture it.

The MLP's gate+up with SwiGLU (`int8_gemm_swiglu`) runs here as one GEMM from SWIGLU_MIN_ROWS rows
(`Library.swiglu_pairs`): the stored gate+up weight's rows alternate gate and up
(`gate_up.interleave_gate_up`), so a tile holds both values of each output and one thread holds
them in neighbouring accumulator registers; the epilogue's own visitor nodes pair them with the
Triton kernels' instructions (`swiglu_value` in the header) and store only v from registers
(`PairNode`), so v has the Triton fused kernel's bits, and `quantize_rows(v, divisor)` follows.
Below SWIGLU_MIN_ROWS the engine's MLP runs the plain stacked GEMM here and then `swiglu_quantize`
on its even and odd columns (`int8_gemm.swiglu_fused`). It replaced (session 27) a two-GEMM form:
the up projection written as fp32 [M, I] and read back as the gate GEMM's C (1.1 GB a layer at the
27B's 8,192 rows), and a second mainloop over the same activations. Measured on an H100 (session
26, one process, 27B, the one-GEMM form then over an interleaved copy of the weight): (b)'s 328 rows
28.56 / 28.71 -> 26.81 ms, (c) 477.5 / 477.9 -> 467.5 ms on SWIZZLED_TILE (`swiglu_config`).
Dividing by ffn_down's SmoothQuant divisor and folding each row's absmax in the same epilogue cost
more than the quantizer's pass saves (~1.1 ms a layer at 8,192 rows), so v alone is written.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

HEADER = Path(__file__).resolve().parent / "cuda" / "int8_gemm_sm90.cuh"
# The long attention tier's own causal block (`forest_attention.FMHA_LONG_TIER`): CUTLASS's Hopper
# FMHA example kernel with a tile scheduler and an epilogue of ours, one translation unit of its own
# in the same library (its header names what it takes from the example and why).
FMHA_HEADER = HEADER.parent / "forest_fmha_sm90.cuh"
FMHA_UNIT = "forest_fmha"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "cutlass"
# Compiled translation units, each named by what went into it (`_unit_key`), shared by every build:
# an edit of the FMHA header recompiles its one unit, not the GEMMs (~1.5 minutes each on two
# cores). Beside CACHE, not in it, since CACHE's libraries travel to the GPU machine.
OBJECTS = REPO / ".cache" / "cutlass-objects"
LIBRARY_NAME = "libprism_int8_gemm.so"
# Where `make cutlass` (`ops/build_cutlass.py --toolchain`) unpacks NVIDIA's nvcc and CUTLASS
# wheels: a folder of its own (pip --target, no dependencies), never the venv, because those
# wheels pin CUDA runtime parts that pip would otherwise "fix" by swapping the venv's torch.
TOOLCHAIN = REPO / ".cache" / "cutlass-toolchain"
# The toolchain's wheels: nvcc and its parts at CUDA 13.0 (the 580 drivers' version) and
# CUTLASS's C++ headers (the nvidia-cutlass wheel carries them).
TOOLCHAIN_WHEELS = (
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-cutlass==4.2.0.0",
)


# The tile schedulers' raster orders by name: CUTLASS's RasterOrderOptions values.
RASTERS = {"heuristic": 0, "m": 1, "n": 2}
# The stream-K scheduler's decompositions (CUTLASS's DecompositionMode values) and how the partials
# of one output tile meet (ReductionMode: a turnstile in K order, or atomically in any order).
DECOMPOSITIONS = {"heuristic": 0, "dataparallel": 1, "splitk": 2, "streamk": 3}
REDUCTIONS = {"deterministic": 0, "nondeterministic": 1}


@dataclass(frozen=True)
class CutlassConfig:
    """One kernel: the CTA tile, the mainloop schedule ("pingpong": two consumer warp groups on
    alternate tiles, one's epilogue under the other's MMAs; "cooperative": both on one tile),
    the tile scheduler ("persistent" or "streamk": K-split work units whose exact int32 partials
    are summed, so the bits cannot change) and the thread-block cluster (CTAs of one cluster
    share an operand tile through TMA multicast: along N, the activation tile)."""

    tile_m: int
    tile_n: int
    tile_k: int
    schedule: str = "pingpong"
    scheduler: str = "persistent"
    cluster_m: int = 1
    cluster_n: int = 1
    # The order the persistent CTAs take output tiles in (CUTLASS's tile scheduler): `swizzle`
    # consecutive tiles along the raster's other dimension, rastered along M or N ("heuristic":
    # along the dimension with fewer tiles). At M = 8,192 a 128x128 wave of 132 CTAs rastered
    # along M touches all 64 activation row-blocks (42 MB at K 5,120) and two weight column
    # blocks, so the activations cycle through L2 once per wave; a swizzle of 8 makes a wave
    # 8 row-blocks by ~16 column blocks. Only the order changes, never a tile's sum: same bits.
    swizzle: int = 1
    raster: str = "heuristic"
    # How the stream-K scheduler cuts the work ("heuristic": CUTLASS's choice among the others;
    # "splitk": every output tile's K into `splits` units; "streamk": the whole K extent of all
    # tiles dealt evenly to the SMs, so no SM waits out a last, partial round of tiles) and how a
    # tile's partials meet ("deterministic": in K order; "nondeterministic": as they come). Why
    # the order is free here: a partial is the tile's int32 accumulator over part of K, and int32
    # sums are exact, so the epilogue sees the same acc whatever the cut or the order.
    decomposition: str = "heuristic"
    splits: int = 1
    reduction: str = "deterministic"

    def __post_init__(self) -> None:
        if self.swizzle not in (1, 2, 4, 8):  # CUTLASS's tile schedulers take these
            raise ValueError(f"swizzle must be 1, 2, 4 or 8, got {self.swizzle}")
        if self.raster not in RASTERS:
            raise ValueError(f"raster must be one of {tuple(RASTERS)}, got {self.raster!r}")
        if self.decomposition not in DECOMPOSITIONS:
            known = tuple(DECOMPOSITIONS)
            raise ValueError(f"decomposition must be one of {known}, got {self.decomposition!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {tuple(REDUCTIONS)}, got {self.reduction!r}")
        if self.scheduler != "streamk" and (
            self.decomposition != "heuristic" or self.splits != 1 or self.reduction != "deterministic"
        ):
            raise ValueError("decomposition, splits and reduction are the stream-K scheduler's")
        if (self.decomposition == "splitk") != (self.splits > 1) or self.splits < 1:
            raise ValueError(f"splits > 1 goes with the split-K decomposition, got {self.splits}")
        if self.scheduler == "streamk" and self.schedule != "cooperative":
            raise ValueError("CUTLASS's stream-K scheduler runs only in the cooperative schedule")

    @property
    def name(self) -> str:
        sched = {"pingpong": "p", "cooperative": "c"}[self.schedule]
        s = f"{sched}{self.tile_m}x{self.tile_n}x{self.tile_k}"
        if self.scheduler == "streamk":
            s += (
                "_sk"
                + {"heuristic": "", "dataparallel": "d", "splitk": str(self.splits), "streamk": "s"}[
                    self.decomposition
                ]
            )
            s += "n" if self.reduction == "nondeterministic" else ""
        if self.cluster_m > 1 or self.cluster_n > 1:
            s += f"_cl{self.cluster_m}x{self.cluster_n}"
        if self.swizzle > 1:
            s += f"_sw{self.swizzle}"
        if self.raster != "heuristic":
            s += f"_r{self.raster}"
        return s

    def source(self) -> str:
        """The translation unit for this config."""
        mainloop, epilogue = {
            "pingpong": ("prism::Pingpong", "prism::PingpongEpilogue"),
            "cooperative": ("prism::Cooperative", "prism::CooperativeEpilogue"),
        }[self.schedule]
        scheduler = {"persistent": "prism::Persistent", "streamk": "prism::StreamK"}[self.scheduler]
        tile = f"cute::Shape<cute::_{self.tile_m}, cute::_{self.tile_n}, cute::_{self.tile_k}>"
        cluster = f"cute::Shape<cute::_{self.cluster_m}, cute::_{self.cluster_n}, cute::_1>"
        raster = RASTERS[self.raster]
        return (
            f'#include "{HEADER.name}"\n'
            f"PRISM_INT8_GEMM({self.name}, PRISM_ARG({tile}), PRISM_ARG({cluster}), {mainloop}, {epilogue}, "
            f"{scheduler}, PRISM_ARG({self.swizzle}, {raster}, {self.splits}, "
            f"{DECOMPOSITIONS[self.decomposition]}, {REDUCTIONS[self.reduction]}))\n"
        )


# The configs measured (`ops/bench/bench_cutlass.py --candidates`, which builds them into a library
# of their own). Measured on an H200 on 2026-12-02 (cold weights in CUDA graphs, the 27B linears as
# the engine stacks them; RESULTS.md session 10).
CANDIDATES: tuple[CutlassConfig, ...] = (
    CutlassConfig(128, 128, 128, "pingpong"),
    CutlassConfig(64, 128, 128, "pingpong"),
    CutlassConfig(128, 128, 128, "cooperative"),
    CutlassConfig(128, 256, 128, "cooperative"),
    CutlassConfig(128, 128, 128, "cooperative", "streamk"),
    CutlassConfig(256, 128, 128, "cooperative"),
    CutlassConfig(256, 128, 64, "cooperative"),
    CutlassConfig(128, 128, 128, "pingpong", cluster_n=2),
    CutlassConfig(128, 128, 128, "pingpong", cluster_m=2),
    CutlassConfig(128, 128, 64, "pingpong"),
    # Narrower tiles (session 14, RESULTS.md): for the 5,120-wide linears at M 129-256, where
    # 128x128 tiles make 80 CTAs for 132 SMs (128x96 and 128x64 kept: NARROW_TILES; 128x80's n80
    # wgmma and the 64x160 / 128x160 shapes lost everywhere)
    CutlassConfig(128, 80, 128, "pingpong"),
    CutlassConfig(64, 160, 128, "pingpong"),
    CutlassConfig(128, 96, 128, "pingpong"),
    CutlassConfig(128, 64, 128, "pingpong"),
    CutlassConfig(128, 160, 128, "pingpong"),
    # 64-row tiles for the decoder's 64-sequence bucket (weight streaming: more CTAs; 64x64x256
    # kept in TABLE)
    CutlassConfig(64, 64, 128, "pingpong"),
    CutlassConfig(64, 96, 128, "pingpong"),
    CutlassConfig(64, 64, 256, "pingpong"),
    # Narrower 64-row tiles for the decoder's narrow outputs (session 24): at M 64 a 5,120-wide
    # output (the GDN and attention output projections, MLP down) is 80 tiles of 64x64 for 132 SMs,
    # and in the H100's 64-sequence step those linears read their weights at 1.7 (K 6,144) and
    # 2.4 TB/s (K 17,408) against 2.5-2.9 for the wide ones; 64x40 makes 128 tiles, 64x32 160.
    # Both lost alone on that H100 (M 64, us: out 15.0 / 16.5 / 18.2 for 64x64 / 64x40 / 64x32,
    # down 35.8 / 37.2 / 45.6): more CTAs, each with less to stream, did not read faster
    CutlassConfig(64, 40, 256, "pingpong"),
    CutlassConfig(64, 32, 256, "pingpong"),
    # The tile order at large M (session 15): swizzles and rasters for the 8,192-row GEMMs
    # (128x128 unclustered in swizzles of 8 kept: SWIZZLED_TILE; the swizzled clusters and the
    # 128x256 tiles lost)
    CutlassConfig(128, 128, 128, "pingpong", cluster_n=2, swizzle=2),
    CutlassConfig(128, 128, 128, "pingpong", cluster_n=2, swizzle=4),
    CutlassConfig(128, 128, 128, "pingpong", cluster_n=2, swizzle=8),
    CutlassConfig(128, 128, 128, "pingpong", cluster_n=2, swizzle=8, raster="n"),
    CutlassConfig(128, 128, 128, "pingpong", swizzle=8),
    CutlassConfig(128, 256, 128, "cooperative", swizzle=8),
    CutlassConfig(128, 256, 128, "cooperative", cluster_m=2, swizzle=4),
    # Stream-K decompositions at M 129-384 (session 16): there a linear is 1-7 rounds of output
    # tiles, and the last round often runs on a few SMs (MLP down at M 256: 80 tiles of 128x128
    # for 132 SMs; gate+up 4.1 rounds at M 256, 6.2 at 384). None kept: the cooperative schedule
    # they need costs more than the idle SMs (H200, 27B step sums at M 128 / 256 / 384: the best
    # pingpong tile 8.65 (128x64) / 11.38 (128x96) / 15.80 ms (128x128); stream-K 10.13 / 12.44 /
    # 17.81, its atomic partials 10.04 / 12.43 / 17.77, heuristic atomic 9.74 / 12.27 / 16.76,
    # split-K by 2 11.21 / 16.24 / 22.50; only MLP down at M 256 gained over 128x128, 47.9 -> 47.0
    # us, against 43.4 for 128x96). Every output bit-equal to the Triton kernel's.
    CutlassConfig(128, 128, 128, "cooperative", "streamk", decomposition="streamk"),
    CutlassConfig(
        128, 128, 128, "cooperative", "streamk", decomposition="streamk", reduction="nondeterministic"
    ),
    CutlassConfig(128, 128, 128, "cooperative", "streamk", reduction="nondeterministic"),
    CutlassConfig(128, 128, 128, "cooperative", "streamk", decomposition="splitk", splits=2),
    CutlassConfig(128, 128, 128, "cooperative", "streamk", decomposition="dataparallel"),
    # Weight tiles multicast to both row tiles at M 129-384 (session 17, built on the CPU, not yet
    # timed): at M 256 the two 128-row tiles of an output column read the same weight tile, and a
    # cluster of two along M fetches it from L2 once for both (TMA multicast), halving the weight
    # traffic into the SMs where (a)'s MLP runs at ~1,200 TOP/s with 128x96 tiles.
    CutlassConfig(128, 96, 128, "pingpong", cluster_m=2),
    CutlassConfig(128, 64, 128, "pingpong", cluster_m=2),
    # 256-deep K steps for the 128-row tiles (session 17, not yet timed): int8 wgmma takes 32 of
    # K an instruction, so a 128-deep stage is 4 of them between the pipeline's barriers; 256
    # halves the barriers and TMA issues per K (64 KB a stage at 128x128: 3 stages fit). The
    # 64x64 tile gained a little from it at M 64 (7.46 -> 7.42 ms a step).
    CutlassConfig(128, 128, 256, "pingpong"),
    CutlassConfig(128, 128, 256, "pingpong", swizzle=8),
    CutlassConfig(128, 96, 256, "pingpong"),
)


def candidates(names: str | None = None) -> tuple[CutlassConfig, ...]:
    """The candidate configs named in a comma list (all of them for None), in CANDIDATES' order."""
    if names is None:
        return CANDIDATES
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = wanted - {c.name for c in CANDIDATES}
    if unknown:
        known = [c.name for c in CANDIDATES]
        raise ValueError(f"unknown CUTLASS configs {sorted(unknown)}; candidates: {known}")
    return tuple(c for c in CANDIDATES if c.name in wanted)


# (largest M, config name or None): None keeps the Triton kernel for that M (decode's M <= 16,
# where the Triton GEMV and split tiles stream the weight faster: 7.02 ms a 27B step at M = 16
# against 8.58 for the best 64-row tile). At M 17-64 (the decoder's 32- and 64-sequence buckets)
# 64x64 tiles with 256-deep K steps stream the weight better than Triton's tiles and stream K:
# 7.42 against 8.24 ms a step at M = 64 (bench_cutlass.py --candidates, H200, 2026-12-04 session
# 14; MLP down 34.0 -> 27.4 us, GDN/attention out 14.6 -> 12.3; 64x128 tiles 8.22, 128x64 12.81)
# and 10.20 against 11.87 at M = 32 (H100, 2026-12-06 session 24: MLP down 51.3 -> 40.7 us,
# GDN/attention out 22.1 -> 16.0, gate+up 74.6 -> 69.4; Triton kept M <= 32 until then).
# Any entry gives the same bits. 27B step sums over the linears
# (ms; Triton's tiles for comparison): the pingpong 128x128x128 tile had the least at M = 256
# (11.7 vs 14.7), 384 (14.4 vs 18.6) and 1,024 (34.1 vs 44.9); at 8,192 the same tile in a
# cluster of two along N (the activation tile multicast to both CTAs) did (292 vs 312 unclustered
# and 321 Triton). The bound between 1,024 and 8,192 is not measured.
TABLE: tuple[tuple[int, str | None], ...] = (
    (16, None),
    (64, "p64x64x256"),
    (2048, "p128x128x128"),
    (1 << 62, "p128x128x128_cl1x2"),
)

# Narrower tiles where the table's 128x128 tile fills the SMs badly, up to NARROW_MAX_ROWS rows:
# a persistent kernel's time is about its rounds of output tiles (ceil(tiles / SMs)) times a
# tile's work, and a narrower tile does a little less per column (its B tile is read for fewer
# outputs). Each choice is (config, cost per output column relative to 128x128), the factors fit
# to an H200's step (bench_cutlass.py at M 128 / 256 / 384, 27B linears, 2026-12-04 session 14):
# at M 256 a 5,120-wide output makes 80 tiles of 128x128 for 132 SMs but 108 of 128x96 (GDN and
# attention out 21.7 -> 19.1 us, MLP down 47.3 -> 43.2; gate+up 79.7 -> 77.7: 6 rounds of 96
# against 5 of 128); at M 128 128x64 tiles (MLP down 47.2 -> 33.6). At M 384 the rule keeps
# 128x128 everywhere, as measured. Which tile serves a call never changes its bits.
NARROW_MAX_ROWS = 384
NARROW_TILES: tuple[tuple[str, float], ...] = (
    ("p128x128x128", 1.0),
    ("p128x96x128", 1.05),
    ("p128x64x128", 1.17),
)
# 64-row tiles as one more narrow choice (HALF_ROW_TILES): a bucket whose
# rows are not a multiple of 128 - 192 (the README's three questions, 160 rows), 320 (a sample
# event with four questions, 281-284 rows) - makes 128-row tiles compute up to 64 rows of padding,
# a quarter of the MMA work at 192 rows; 64-row tiles compute 64 at most. Their cost per output
# column is taken as 128x64's (1.17; session 10 put the 64x128 tile 10% behind 128x128 at M 256,
# where both compute 256 rows), so ties keep the 128-row tiles: M 128 and 256 choose as before.
# On since the H200 run of 2026-12-05 (session 17, bench_engine.py --variants, one process, 27B):
# the README's three questions 23.83 -> 17.59 ms; (a), (b), (c), (d) within noise (19.17 / 19.11,
# 25.83 / 26.00, 454.0 / 454.4 ms, 70.1 / 70.5 req/s). Same bits.
HALF_ROW_TILES = True
HALF_ROW_TILE = ("p64x128x128", 1.17)

# Where the table names the clustered tile (above 2,048 rows), outputs at most
# SWIZZLED_MAX_COLUMNS wide take SWIZZLED_TILE instead: 128x128 tiles, unclustered, in swizzles of
# 8 row-blocks. A 5,120-wide output is 40 tiles across against 64 down at M 8,192, so CUTLASS's
# own order walks along N and each wave of 132 CTAs reads the whole weight (89 MB for MLP down,
# more than L2); swizzled, a wave is 8 row-blocks by ~16 column blocks. H200, 27B linears at
# M 8,192 (bench_cutlass.py --candidates, 2026-12-04 session 15, us): MLP down 1,150 -> 1,063,
# GDN out 388 -> 356, attention out 386 -> 365; the wide outputs (GDN in 16,480, attention in
# 14,336, MLP gate+up 34,816) keep the cluster (981 against 998 for GDN in). Same bits.
SWIZZLED_MAX_COLUMNS = 8192
SWIZZLED_TILE = "p128x128x128_sw8"

# What the engine's library holds: the configs the tables name (each costs ~1 min of nvcc).
CONFIGS: tuple[CutlassConfig, ...] = tuple(
    c
    for c in CANDIDATES
    if c.name in {n for _, n in TABLE} | {n for n, _ in NARROW_TILES} | {HALF_ROW_TILE[0], SWIZZLED_TILE}
)


# From how many rows the MLP takes the one-GEMM SwiGLU where the table serves M (module docstring);
# below, the stacked GEMM then `swiglu_quantize`. Above the decoder's 64-row bucket: on an H100
# (session 27, one process, 27B, 0 against the two-GEMM form's 257) (a)'s 256 rows 20.82 / 20.84 ->
# 20.59 / 20.69 ms and the README's (b) (192 rows) 19.43 / 19.48 -> 19.06 / 19.13, decode at 1 and
# 64 sequences unchanged (their buckets, and the 5-16-row ones, not timed, keep the unfused path).
# Triton's fused kernel instead of this form up to 512 rows lost in the engine the same session
# ((a) +1.1 ms, (b) +1.1-1.7, README (b) +5-6), although alone at 384 rows it took 145 us against
# 185-225 for every CUTLASS tile (`bench_cutlass.py --pairs`). Benches set 0 (always) or 1 << 62 (never).
SWIGLU_MIN_ROWS = 65

# Whether the one-GEMM SwiGLU takes SWIZZLED_TILE where the table names its clustered tile (above
# 2,048 rows), although its output (34,816 columns at 27B) is wider than SWIZZLED_MAX_COLUMNS: on
# an H100 (session 26, one process, 27B) (c) took 467.5 ms swizzled against 478.9 clustered, and
# the 328-row bucket lost 5 ms on the swizzled tile, so the swizzle is for the clustered bucket
# only. Alone at 8,192 rows (session 27, `bench_cutlass.py --pairs`, H100, us) it is also the
# fastest of eight tiles: 2,173 against 2,246 (clustered 1x2, swizzled 8), 2,315 (clustered 2x1),
# 2,334 (cooperative 128x256, clustered 2x1) and 2,548-2,810 for the rest. Which tile serves never
# changes the bits.
SWIGLU_SWIZZLE = True


def swiglu_config(name: str) -> str:
    """The one-GEMM SwiGLU's config where `config_for(M, 2I)` gives `name`: SWIZZLED_TILE for the
    table's clustered tile if SWIGLU_SWIZZLE, else `name`."""
    return SWIZZLED_TILE if SWIGLU_SWIZZLE and name == TABLE[-1][1] else name


def swiglu_serves(m: int) -> bool:
    """Whether M rows take the one-GEMM SwiGLU (where the table also serves M)."""
    return m >= SWIGLU_MIN_ROWS


_CANDIDATE_BY_NAME = {c.name: c for c in CANDIDATES}


def config_for(m: int, n: int | None = None, sm_count: int | None = None) -> str | None:
    """The config name that serves M rows (of N outputs, on sm_count SMs), or None (the Triton
    kernel): TABLE's entry for M; for its last entry and N known, at most SWIZZLED_MAX_COLUMNS
    outputs, SWIZZLED_TILE; at most NARROW_MAX_ROWS rows (N and the SMs known, the table naming
    the 128x128 tile), the NARROW_TILES choice (and HALF_ROW_TILE, if HALF_ROW_TILES) with the
    least rounds of tiles."""
    name = next((name for max_m, name in TABLE if m <= max_m), TABLE[-1][1])
    if name == TABLE[-1][1] and n is not None and n <= SWIZZLED_MAX_COLUMNS:
        return SWIZZLED_TILE
    if name != NARROW_TILES[0][0] or m > NARROW_MAX_ROWS or n is None or not sm_count:
        return name

    def cost(choice: tuple[str, float]) -> float:
        c = _CANDIDATE_BY_NAME[choice[0]]
        tiles = -(-m // c.tile_m) * -(-n // c.tile_n)
        return -(-tiles // sm_count) * c.tile_m * c.tile_n * choice[1]

    choices = NARROW_TILES + ((HALF_ROW_TILE,) if HALF_ROW_TILES else ())
    return min(choices, key=cost)[0]  # ties: the first, the widest


def digest(configs: tuple[CutlassConfig, ...] = CONFIGS) -> str:
    """Names the build: the headers' text and every config's source."""
    h = hashlib.sha256(HEADER.read_bytes())
    h.update(FMHA_HEADER.read_bytes())
    for c in configs:
        h.update(c.source().encode())
    return h.hexdigest()[:16]


def default_library(configs: tuple[CutlassConfig, ...] = CONFIGS) -> Path:
    return CACHE / digest(configs) / LIBRARY_NAME


def install_toolchain(target: Path = TOOLCHAIN) -> Path:
    """Unpack `TOOLCHAIN_WHEELS` into `target` (once): no dependencies resolved, nothing of the
    venv touched. Returns target."""
    stamp = target / ".installed"
    wanted = "\n".join(TOOLCHAIN_WHEELS)
    if stamp.exists() and stamp.read_text() == wanted:
        return target
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target)]
    run = subprocess.run([*cmd, *TOOLCHAIN_WHEELS], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"pip could not install the CUTLASS toolchain:\n{run.stderr[-4000:]}")
    stamp.write_text(wanted)
    return target


def _nvcc() -> str:
    """nvcc from CUDA_HOME, PATH, the toolchain folder (`make cutlass`) or wheels on sys.path."""
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    roots = [TOOLCHAIN, *(Path(entry) for entry in sys.path if entry)]
    wheels = [c for root in roots for c in sorted(root.glob("nvidia/cu*/bin/nvcc"))]
    if wheels:
        return str(wheels[0])
    raise FileNotFoundError("no nvcc: install the CUDA toolkit or run `make cutlass` (NVIDIA's wheels)")


def _cutlass_include() -> list[Path]:
    """CUTLASS's headers: CUTLASS_HOME, the toolchain folder's nvidia-cutlass, or that wheel on
    sys.path; with them its Hopper FMHA example's folder, whose collective the FMHA unit includes."""
    home = os.environ.get("CUTLASS_HOME")
    if home:
        root = Path(home)
    elif (TOOLCHAIN / "cutlass_library" / "source" / "include").is_dir():
        root = TOOLCHAIN / "cutlass_library" / "source"
    else:
        import importlib.util

        spec = importlib.util.find_spec("cutlass_library")
        if spec is None or spec.origin is None:
            raise FileNotFoundError("no CUTLASS headers: set CUTLASS_HOME or run `make cutlass`")
        root = Path(spec.origin).parent / "source"
    return [root / "include", root / "tools" / "util" / "include", root / "examples" / "88_hopper_fmha"]


def _unit_key(source: str, header: Path, command: list[str]) -> str:
    """Names a translation unit's object: its source, the header of ours it includes (the GEMMs'
    or the FMHA's; neither includes the other), and the whole nvcc command but for its file names
    (the compiler, the flags, the CUTLASS include folders), with the pinned toolchain wheels for
    what those folders hold."""
    h = hashlib.sha256(source.encode())
    h.update(header.read_bytes())
    h.update("\0".join(command).encode())
    h.update("\0".join(TOOLCHAIN_WHEELS).encode())
    return h.hexdigest()[:16]


def build(
    out: Path | None = None,
    jobs: int | None = None,
    configs: tuple[CutlassConfig, ...] = CONFIGS,
    objects: Path | None = OBJECTS,
) -> Path:
    """Compile `configs` into one shared library; returns its path (kept if already built). A unit
    whose object `objects` holds (`_unit_key`) is not compiled again; None compiles every unit."""
    lib = out or default_library(configs)
    if lib.exists():
        return lib
    work = lib.parent / "src"
    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(HEADER, work / HEADER.name)
    shutil.copy(FMHA_HEADER, work / FMHA_HEADER.name)
    nvcc = _nvcc()
    cuda_root = Path(nvcc).resolve().parent.parent
    flags = [
        "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
        "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC",
        f"-I{work}",
    ] + [f"-I{p}" for p in _cutlass_include()]  # fmt: skip
    # (name, source, extra flags, the header of ours it includes): the GEMMs without FMA contraction
    # (their epilogue's bits); the FMHA unit with it, as CUTLASS builds it (its bits need only be
    # the same run to run)
    units = [(c.name, c.source(), ["-fmad=false"], HEADER) for c in configs]
    units.append((FMHA_UNIT, f'#include "{FMHA_HEADER.name}"\n', [], FMHA_HEADER))

    def compile_one(unit: tuple[str, str, list[str], Path]) -> Path:
        name, source, extra, header = unit
        src = work / f"{name}.cu"
        src.write_text(source)
        obj = work / f"{name}.o"
        # the key leaves out the work folder: another digest's build of the same unit is the same
        key = _unit_key(source, header, [nvcc, *[f for f in flags if f != f"-I{work}"], *extra])
        kept = objects / f"{name}-{key}.o" if objects is not None else None
        if kept is not None and kept.exists():
            shutil.copy(kept, obj)
            return obj
        cmd = [nvcc, *flags, *extra, "-c", str(src), "-o", str(obj)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"nvcc failed on {name}:\n{run.stderr[-4000:]}")
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_suffix(f".{os.getpid()}.tmp")
            shutil.copy(obj, tmp)
            tmp.rename(kept)  # whole or absent, for a build running beside this one
        return obj

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, units))
    tmp = lib.with_suffix(".tmp")
    link = [nvcc, "-shared", "-cudart", "static", f"-L{cuda_root / 'lib'}", f"-L{cuda_root / 'lib64'}"]
    link += ["-gencode=arch=compute_90a,code=sm_90a", "-o", str(tmp), *map(str, objects)]
    run = subprocess.run(link, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"link failed:\n{run.stderr[-4000:]}")
    tmp.rename(lib)
    log.info("cutlass_built", library=str(lib), configs=[c.name for c in configs])
    return lib


# `cuda/forest_fmha_sm90.cuh`'s head size and query tile (its kHeadDim and kTileRows): a segment's
# tail tile reads up to a tile less one row past the call's last row, so Q and K/V carry that
# many more (`forest_attention` plans in these tiles and pads by them)
FMHA_HEAD_DIM = 256
FMHA_TILE_ROWS = 128


def check_forest_fmha_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tiles: torch.Tensor,
    count: torch.Tensor,
    rows: int,
) -> None:
    """Raise ValueError unless the operands are what `prism_forest_fmha` reads and writes through
    raw pointers: q bf16 [rows, nh, 256] contiguous with storage for FMHA_TILE_ROWS more rows (a tail
    tile loads them), k and v bf16 [kv_rows >= rows + FMHA_TILE_ROWS, nkv, 256] contiguous with nkv
    dividing nh, out fp32 [rows, nh, 256] and lse fp32 [rows, nh] contiguous, tiles int32 [capacity,
    4] and count int32 [1], all on one device. A wrong one would not fail in the kernel: it would
    read or write other memory."""
    if q.dim() != 3 or q.dtype != torch.bfloat16 or not q.is_contiguous() or q.shape[0] < rows:
        raise ValueError(
            f"forest FMHA: q must be contiguous bf16 [>= {rows}, nh, 256], got {q.dtype} {tuple(q.shape)}"
        )
    nh, hd = q.shape[1], q.shape[2]
    if hd != FMHA_HEAD_DIM:
        raise ValueError(f"forest FMHA: head dim must be {FMHA_HEAD_DIM}, got {hd}")
    room = q.untyped_storage().nbytes() // q.element_size() - q.storage_offset()
    if room < (rows + FMHA_TILE_ROWS) * nh * hd:
        raise ValueError(f"forest FMHA: q's storage must hold {FMHA_TILE_ROWS} rows past its {rows}")
    for name, kv in (("k", k), ("v", v)):
        if kv.dim() != 3 or kv.dtype != torch.bfloat16 or not kv.is_contiguous() or kv.shape[2] != hd:
            raise ValueError(
                f"forest FMHA: {name} must be contiguous bf16 [rows, nkv, 256], got {tuple(kv.shape)}"
            )
    if k.shape != v.shape or nh % k.shape[1] or k.shape[0] < rows + FMHA_TILE_ROWS:
        raise ValueError(
            f"forest FMHA: k and v must be [>= {rows + FMHA_TILE_ROWS}, nkv | {nh}, {hd}], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if (
        out.dtype != torch.float32
        or not out.is_contiguous()
        or out.shape[0] < rows
        or out[:1].numel() != nh * hd
    ):
        raise ValueError(
            f"forest FMHA: out must be contiguous fp32 [rows, {nh}, {hd}], got {tuple(out.shape)}"
        )
    if lse.dtype != torch.float32 or not lse.is_contiguous() or tuple(lse.shape) != (rows, nh):
        raise ValueError(f"forest FMHA: lse must be contiguous fp32 [{rows}, {nh}], got {tuple(lse.shape)}")
    if tiles.dtype != torch.int32 or tiles.dim() != 2 or tiles.shape[1] != 4 or not tiles.is_contiguous():
        raise ValueError(
            f"forest FMHA: tiles must be contiguous int32 [capacity, 4], got {tuple(tiles.shape)}"
        )
    if count.dtype != torch.int32 or count.numel() != 1:
        raise ValueError(f"forest FMHA: count must be int32 [1], got {count.dtype} {tuple(count.shape)}")
    devices = {t.device for t in (q, k, v, out, lse, tiles, count)}
    if len(devices) != 1:
        raise ValueError(f"forest FMHA: operands on several devices: {sorted(map(str, devices))}")


# `prism_forest_fmha`'s parameters as ctypes reads them: (q, k, v, out, lse, tiles, count) pointers,
# (capacity, rows, kv_rows, heads, kv heads) ints, the stream. ctypes cannot check
# them against the C signature (a missing int would pass the stream where an int is read), so a
# CPU test does, from the header's text.
FOREST_FMHA_ARGTYPES = (ctypes.c_void_p,) * 7 + (ctypes.c_int,) * 5 + (ctypes.c_void_p,)


class Library:
    """The built library's entry points, called on torch tensors."""

    def __init__(self, path: Path, configs: tuple[CutlassConfig, ...] = CONFIGS) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._run: dict[str, ctypes._CFuncPtr] = {}
        self._swiglu_pairs: dict[str, ctypes._CFuncPtr] = {}
        self._workspace_bytes: dict[str, ctypes._CFuncPtr] = {}
        for c in configs:
            # (a, w, a_scale, w_scale, residual or null, y, m, n, k, workspace, stream) and
            # (a, w, a_scale, w_scale, v, m, n, k, workspace, stream)
            for table, symbol, pointers in (
                (self._run, "prism_int8_gemm_", 6),
                (self._swiglu_pairs, "prism_int8_gemm_swiglu_pairs_", 5),
            ):
                entry = getattr(self._lib, symbol + c.name)
                entry.restype = ctypes.c_int
                entry.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2
                table[c.name] = entry
            ws = getattr(self._lib, f"prism_int8_gemm_{c.name}_workspace")
            ws.restype = ctypes.c_size_t
            ws.argtypes = [ctypes.c_int] * 3
            self._workspace_bytes[c.name] = ws
        self._workspaces: dict[tuple[str, int, int, int, int], torch.Tensor] = {}
        # None in a library built before the unit existed (`PRISM_CUTLASS_LIB`)
        self._forest_fmha = getattr(self._lib, "prism_forest_fmha", None)
        if self._forest_fmha is not None:
            self._forest_fmha.restype = ctypes.c_int
            self._forest_fmha.argtypes = list(FOREST_FMHA_ARGTYPES)

    @property
    def has_forest_fmha(self) -> bool:
        return self._forest_fmha is not None

    def forest_fmha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        tiles: torch.Tensor,
        count: torch.Tensor,
        rows: int,
    ) -> None:
        """The long tier's own causal blocks (`cuda/forest_fmha_sm90.cuh`): q bf16 [>= rows + 128,
        nh, 256], k / v bf16 [kv_rows, nkv, 256] (kv_rows >= rows + 128), out fp32 [rows, nh * 256]
        and lse fp32 [rows, nh] get the listed tiles' rows (`forest_attention.fmha_plan`'s tiles
        int32 [capacity, 4] and count int32 [1]); `check_forest_fmha_operands` says what else."""
        if self._forest_fmha is None:
            raise RuntimeError(f"{self.path} has no forest FMHA unit: rebuild it (`make cutlass`)")
        check_forest_fmha_operands(q, k, v, out, lse, tiles, count, rows)
        kv_rows, nkv, _ = k.shape
        with torch.cuda.device(q.device):
            rc = self._forest_fmha(
                q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), tiles.data_ptr(),
                count.data_ptr(), tiles.shape[0], rows, kv_rows, q.shape[1], nkv,
                torch.cuda.current_stream(q.device).cuda_stream,
            )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"CUTLASS forest FMHA failed ({rc}) at rows={rows} heads={q.shape[1]}/{nkv}")

    def _workspace(self, name: str, m: int, n: int, k: int, device: torch.device) -> int:
        """A zeroed buffer per (config, shape, device), kept: a captured graph holds its address,
        and stream K's tile counters expect zeros between launches (each launch leaves them so)."""
        key = (name, m, n, k, device.index or 0)
        buf = self._workspaces.get(key)
        if buf is None:
            size = int(self._workspace_bytes[name](m, n, k))
            buf = torch.zeros(max(size, 16), dtype=torch.uint8, device=device)
            self._workspaces[key] = buf
        return buf.data_ptr()

    def gemm(
        self,
        name: str,
        a: torch.Tensor,
        w: torch.Tensor,
        a_scale: torch.Tensor,
        w_scale: torch.Tensor,
        residual: torch.Tensor | None,
        y: torch.Tensor,
    ) -> None:
        """y = the int8 GEMM with its epilogue by config `name` (`serves` says which calls fit)."""
        self._call(self._run[name], name, a, w, a_scale, w_scale, residual, y)

    def swiglu_pairs(
        self,
        name: str,
        a: torch.Tensor,
        w_pairs: torch.Tensor,
        a_scale: torch.Tensor,
        w_scale_pairs: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """The one-GEMM SwiGLU: w_pairs int8 [2I, K] and w_scale_pairs [2I] the stacked gate+up
        interleaved (row 2j gate j, 2j + 1 up j: `gate_up.interleave_gate_up`); v fp32 [M, I]
        gets silu(g) * u with `int8_gemm_swiglu`'s bits, g and u the plain GEMM's columns 2j, 2j + 1."""
        if v.shape != (a.shape[0], w_pairs.shape[0] // 2) or not v.is_contiguous():
            raise ValueError(f"swiglu_pairs: v must be contiguous [{a.shape[0]}, {w_pairs.shape[0] // 2}]")
        self._call(self._swiglu_pairs[name], name, a, w_pairs, a_scale, w_scale_pairs, v)

    def _call(
        self,
        entry: ctypes._CFuncPtr,
        name: str,
        a: torch.Tensor,
        w: torch.Tensor,
        a_scale: torch.Tensor,
        w_scale: torch.Tensor,
        *rest: torch.Tensor | None,
    ) -> None:
        """One entry point's launch: (a, w, a_scale, w_scale, *rest, m, n, k, workspace, stream),
        `rest` the entry's other operands in its order (None: a null pointer)."""
        m, k = a.shape
        n = w.shape[0]
        operands = (a, w, a_scale.contiguous(), w_scale.contiguous(), *rest)
        with torch.cuda.device(a.device):  # the library reads the current device (its SM count)
            rc = entry(
                *(0 if t is None else t.data_ptr() for t in operands), m, n, k,
                self._workspace(name, m, n, k, a.device), torch.cuda.current_stream(a.device).cuda_stream,
            )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"CUTLASS int8 GEMM {name} failed ({rc}) at M={m} N={n} K={k}")


@cache
def library() -> Library | None:
    """The built library, or None (not built, turned off, or no sm_90 GPU)."""
    if os.environ.get("PRISM_CUTLASS", "1") == "0" or not torch.cuda.is_available():
        return None
    if torch.cuda.get_device_capability() != (9, 0):
        return None
    path = Path(os.environ["PRISM_CUTLASS_LIB"]) if os.environ.get("PRISM_CUTLASS_LIB") else default_library()
    if not path.exists():
        return None
    lib = Library(path)
    log.info("cutlass_loaded", library=str(path))
    return lib


def serves(
    a: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None, out_dtype: torch.dtype
) -> str | None:
    """The config that takes this call, or None: CUDA, fp32 out, a table entry for M, TMA's
    16-byte rules (contiguous rows, K % 16 == 0, N % 4 == 0) and the library present."""
    if not a.is_cuda or out_dtype != torch.float32 or not a.is_contiguous():
        return None
    if residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()):
        return None
    return serves_rows(a.shape[0], w)


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def serves_rows(m: int, w: torch.Tensor) -> str | None:
    """The config that would take M contiguous activation rows times w (CUDA, fp32 out, no
    residual), or None: what `serves` says before the activations exist."""
    if not w.is_cuda or m == 0:
        return None
    n, k = w.shape
    if k % 16 or n % 4 or not w.is_contiguous() or library() is None:
        return None
    return config_for(m, n, _sm_count(w.device))
