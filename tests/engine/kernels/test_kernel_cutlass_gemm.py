"""The CUTLASS int8 GEMM (`engine.kernels.cutlass_gemm`).

On an sm_90 GPU with the library built (`make cutlass`): every
config's y, with and without a residual, equals the torch reference bit for bit (the exact int32
sum, then (acc * a_scale) * w_scale (+ residual) with no FMA); a row's bits do not depend on how
many rows share the call or where it lies; `int8_gemm`'s "auto" hands the table's M buckets to
it and gives the Triton kernel's bits; the one-GEMM SwiGLU (`Library.swiglu_pairs` over the
gate/up-interleaved weight, the engine's `int8_gemm_swiglu` from SWIGLU_MIN_ROWS rows) gives the
Triton fused kernel's bits, so a row's v is the same whichever backend its batch's M picks, and
its quantized v the unfused path's codes. Everywhere: the table, the sources the build writes, the
digest that names a build, the dispatch's refusals (CPU tensors, bf16 out, misaligned shapes, no
library); and, where nvcc and CUTLASS's headers are installed, a real build of one config whose
library exports the entry points the loader binds.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from engine.kernels import cutlass_gemm
from engine.kernels.cutlass_gemm import CONFIGS, TABLE, CutlassConfig, config_for
from engine.kernels.int8_gemm import int8_gemm, int8_gemm_reference, int8_gemm_swiglu

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
LIBRARY = cutlass_gemm.library() if ON_HOPPER else None
needs_library = pytest.mark.skipif(LIBRARY is None, reason="needs an sm_90 GPU and the built CUTLASS library")


def _operands(m: int, n: int, k: int, seed: int, residual: bool):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    a_scale = torch.rand(m, generator=gen) * 0.02 + 1e-3
    w_scale = torch.rand(n, generator=gen) * (1.0 / k) + 1e-4
    res = torch.randn(m, n, generator=gen) if residual else None
    return a, w, a_scale, w_scale, res


def _cuda(*ts):
    return [None if t is None else t.cuda() for t in ts]


# --- everywhere ---------------------------------------------------------------------------------


def test_the_table_covers_every_m_and_names_built_configs() -> None:
    assert len({c.name for c in cutlass_gemm.CANDIDATES}) == len(cutlass_gemm.CANDIDATES), "a shared name"
    names = {c.name for c in CONFIGS}
    assert set(CONFIGS) <= set(cutlass_gemm.CANDIDATES)
    bounds = [m for m, _ in TABLE]
    assert bounds == sorted(bounds) and bounds[-1] >= 1 << 62
    assert all(name is None or name in names for _, name in TABLE)
    for m in (1, 16, 64, 65, 256, 1024, 2048, 2049, 8192, 1 << 40):
        want = next(name for max_m, name in TABLE if m <= max_m)
        assert config_for(m) == want
        if m > cutlass_gemm.NARROW_MAX_ROWS and want != TABLE[-1][1]:  # N changes nothing here
            assert all(config_for(m, n, 132) == want for n in (64, 5120, 34816))
    assert {name for name, _ in cutlass_gemm.NARROW_TILES} <= names
    assert cutlass_gemm.SWIZZLED_TILE in names


def test_narrow_outputs_take_the_swizzled_tile_where_the_table_clusters() -> None:
    """Above 2,048 rows the table names the 1x2-clustered tile; outputs at most 8,192 wide (the
    27B's 5,120-wide out and down projections) take 128x128 tiles in swizzles of 8 instead."""
    assert TABLE[-2][0] == 2048 and TABLE[-1][1] == "p128x128x128_cl1x2"
    assert cutlass_gemm.SWIZZLED_MAX_COLUMNS == 8192
    for m in (2049, 8192, 1 << 40):
        assert config_for(m, 5120, 132) == config_for(m, 8192) == "p128x128x128_sw8"
        assert config_for(m, 8196, 132) == config_for(m, 16480) == "p128x128x128_cl1x2"
        assert config_for(m) == "p128x128x128_cl1x2"  # N unknown: the table's entry
    assert config_for(2048, 5120, 132) == "p128x128x128"


def test_the_one_gemm_swiglu_takes_the_swizzled_tile_only_where_the_table_clusters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`swiglu_config`: SWIZZLED_TILE in place of the table's clustered tile (its last entry) while
    SWIGLU_SWIZZLE is on; every other tile, and every tile with it off, as given."""
    clustered = TABLE[-1][1]
    assert cutlass_gemm.SWIGLU_SWIZZLE is True
    assert cutlass_gemm.swiglu_config(clustered) == cutlass_gemm.SWIZZLED_TILE
    for m in (65, 300, 2048):
        name = config_for(m, 34816, 132)
        assert name is not None and name != clustered
        assert cutlass_gemm.swiglu_config(name) == name
    monkeypatch.setattr(cutlass_gemm, "SWIGLU_SWIZZLE", False)
    assert cutlass_gemm.swiglu_config(clustered) == clustered


def test_a_configs_name_and_source_carry_its_tile_order() -> None:
    """The swizzle and raster are template arguments of the config's kernel (the digest then
    changes with them) and suffixes of its name; the defaults keep the plain names."""
    plain = CutlassConfig(128, 128, 128)
    assert plain.name == "p128x128x128" and "PRISM_ARG(1, 0, 1, 0, 0))" in plain.source()
    sw = CutlassConfig(128, 128, 128, cluster_n=2, swizzle=8, raster="n")
    assert sw.name == "p128x128x128_cl1x2_sw8_rn" and "PRISM_ARG(8, 2, 1, 0, 0))" in sw.source()
    assert CutlassConfig(128, 128, 128, raster="m").name == "p128x128x128_rm"
    with pytest.raises(ValueError, match="swizzle"):
        CutlassConfig(128, 128, 128, swizzle=3)
    with pytest.raises(ValueError, match="raster"):
        CutlassConfig(128, 128, 128, raster="k")


def test_a_stream_k_configs_decomposition_is_in_its_name_and_source() -> None:
    """The stream-K scheduler's decomposition, split count and reduction are template arguments
    (DecompositionMode 2 = split-K, 3 = stream-K; ReductionMode 1 = atomic) and name suffixes
    (none for the heuristic, so the former `_sk` name stays); they belong to that scheduler, which
    CUTLASS runs only in the cooperative schedule, and split counts go with split-K alone."""
    sk = CutlassConfig(128, 128, 128, "cooperative", "streamk")
    assert sk.name == "c128x128x128_sk" and "PRISM_ARG(1, 0, 1, 0, 0))" in sk.source()
    split = CutlassConfig(128, 128, 128, "cooperative", "streamk", decomposition="splitk", splits=2)
    assert split.name == "c128x128x128_sk2" and "PRISM_ARG(1, 0, 2, 2, 0))" in split.source()
    atomic = CutlassConfig(
        128, 128, 128, "cooperative", "streamk", decomposition="streamk", reduction="nondeterministic"
    )
    assert atomic.name == "c128x128x128_sksn" and "PRISM_ARG(1, 0, 1, 3, 1))" in atomic.source()
    for bad, match in (
        (dict(decomposition="streamk"), "stream-K scheduler's"),  # persistent scheduler
        (dict(scheduler="streamk"), "cooperative"),  # pingpong schedule
        (dict(schedule="cooperative", scheduler="streamk", splits=2), "split-K"),
        (dict(schedule="cooperative", scheduler="streamk", decomposition="splitk"), "split-K"),
        (dict(schedule="cooperative", scheduler="streamk", decomposition="rows"), "decomposition"),
        (dict(schedule="cooperative", scheduler="streamk", reduction="racy"), "reduction"),
    ):
        with pytest.raises(ValueError, match=match):
            CutlassConfig(128, 128, 128, **bad)  # type: ignore[arg-type]


def test_narrow_tiles_are_chosen_by_rounds_of_tiles_over_the_sms() -> None:
    """Hand-counted on 132 SMs: at M 256 a 5,120-wide output is 80 tiles of 128x128 or 108 of
    128x96 (one round each: the narrower does less) or 160 of 128x64 (two rounds); 16,480 wide,
    2 x 129 = 258 tiles of 128 (two rounds) against 3 rounds of 96 or 4 of 64; 34,816 wide, 544
    tiles (5 rounds of 128 columns = 640) against 726 (6 rounds of 96 = 576 x 1.05)."""
    assert cutlass_gemm.NARROW_TILES[0][0] == "p128x128x128"
    assert config_for(256, 5120, 132) == "p128x96x128"
    assert config_for(256, 16480, 132) == "p128x128x128"
    assert config_for(256, 34816, 132) == "p128x96x128"
    assert config_for(128, 5120, 132) == "p128x64x128"  # 40 / 54 / 80 tiles: one round each
    assert config_for(384, 5120, 132) == "p128x128x128"  # 120 tiles, against 162 (2 rounds)
    # on 1,000 SMs every tile is one round (80 / 108 / 160 tiles): the narrowest does least
    assert config_for(256, 5120, 1000) == "p128x64x128"
    # without N or the SM count, or where the table names another config, the table's entry
    assert config_for(256) == config_for(256, 5120) == config_for(256, None, 132) == "p128x128x128"
    assert config_for(64, 5120, 132) == config_for(32, 5120, 132) == config_for(64)  # the 64-row tile
    assert config_for(16, 5120, 132) is None  # Triton's GEMV and split tiles


def test_half_row_tiles_serve_buckets_that_128_row_tiles_pad(monkeypatch: pytest.MonkeyPatch) -> None:
    """HALF_ROW_TILES, hand-counted on 132 SMs: at M 192 a 5,120-wide output is 3 x 40 = 120 tiles
    of 64x128 (one round of 64 x 128 x 1.17 = 9,585) against 108 of 128x96 (one round of 12,902);
    34,816 wide, 816 tiles (7 rounds: 67,095) against 726 of 128x96 (6 rounds: 77,414); at M 128
    and 256, where 128-row tiles pad nothing, the choices stay (128 ties 128x64 and keeps it)."""
    assert cutlass_gemm.HALF_ROW_TILE[0] in {c.name for c in CONFIGS}  # in the engine's library
    monkeypatch.setattr(cutlass_gemm, "HALF_ROW_TILES", False)
    off = {(m, n): config_for(m, n, 132) for m in (128, 192, 256, 320, 384) for n in (5120, 16480, 34816)}
    assert off[192, 5120] == "p128x96x128"  # 108 tiles, one round
    monkeypatch.setattr(cutlass_gemm, "HALF_ROW_TILES", True)
    half = cutlass_gemm.HALF_ROW_TILE[0]
    assert config_for(192, 5120, 132) == config_for(192, 34816, 132) == config_for(192, 16480, 132) == half
    assert config_for(320, 17408, 132) == half  # 5 x 136 = 680 tiles, 6 rounds, against 4 of 128x128
    assert config_for(320, 5120, 132) == "p128x128x128"  # 200 tiles: 2 rounds, against 1 of 120
    for m in (128, 256, 384):
        assert all(config_for(m, n, 132) == off[m, n] for n in (5120, 16480, 34816)), m
    assert config_for(192) == config_for(192, 5120) == "p128x128x128"  # N or SMs unknown: the table's


def test_each_config_source_declares_its_entry_points() -> None:
    for c in CONFIGS:
        src = c.source()
        assert f"PRISM_INT8_GEMM({c.name}," in src
        assert cutlass_gemm.HEADER.name in src
        assert f"cute::_{c.tile_m}, cute::_{c.tile_n}, cute::_{c.tile_k}" in src
    header = cutlass_gemm.HEADER.read_text()
    # the entry points the loader binds are the ones the macro defines
    assert "prism_int8_gemm_##NAME##_workspace" in header and "prism_int8_gemm_##NAME(" in header
    assert "prism_int8_gemm_swiglu_pairs_##NAME(" in header
    assert "-fmad=false" in Path(cutlass_gemm.__file__).read_text()  # the epilogue's bits depend on it


def test_the_digest_names_the_headers_and_the_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = cutlass_gemm.digest()
    assert cutlass_gemm.digest() == base
    assert cutlass_gemm.digest(cutlass_gemm.CANDIDATES) != base
    edited = tmp_path / cutlass_gemm.HEADER.name
    edited.write_text(cutlass_gemm.HEADER.read_text() + "\n// edited\n")
    monkeypatch.setattr(cutlass_gemm, "HEADER", edited)
    assert cutlass_gemm.digest() != base
    assert cutlass_gemm.default_library().parent.name == cutlass_gemm.digest()
    monkeypatch.undo()
    fmha = tmp_path / cutlass_gemm.FMHA_HEADER.name  # the FMHA unit's header is in the build too
    fmha.write_text(cutlass_gemm.FMHA_HEADER.read_text() + "\n// edited\n")
    monkeypatch.setattr(cutlass_gemm, "FMHA_HEADER", fmha)
    assert cutlass_gemm.digest() != base


def test_calls_it_cannot_take_stay_with_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    a, w, _, _, res = _operands(256, 64, 64, 1, True)
    assert cutlass_gemm.serves(a, w, res, torch.float32) is None  # CPU tensors
    monkeypatch.setattr(cutlass_gemm, "library", lambda: object())  # as if built: the rules alone
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(cutlass_gemm, "_sm_count", lambda device: 132)
    assert cutlass_gemm.serves(a, w, res, torch.float32) == config_for(256, 64, 132)
    assert cutlass_gemm.serves(a, w, res, torch.bfloat16) is None
    assert cutlass_gemm.serves(a[:16], w, None, torch.float32) == config_for(16)  # None: decode
    k40 = (a[:, :40].contiguous(), w[:, :40].contiguous())
    assert cutlass_gemm.serves(*k40, None, torch.float32) is None  # K % 16
    assert cutlass_gemm.serves(a, w[:62], None, torch.float32) is None  # N % 4
    assert cutlass_gemm.serves(a, w, res.bfloat16(), torch.float32) is None
    assert cutlass_gemm.serves(a[:0], w, None, torch.float32) is None
    monkeypatch.setattr(cutlass_gemm, "library", lambda: None)
    assert cutlass_gemm.serves(a, w, res, torch.float32) is None


def test_the_forest_fmha_refuses_operands_its_pointers_cannot_take() -> None:
    """`check_forest_fmha_operands` (run before every `Library.forest_fmha` call, which hands raw
    pointers to the kernel) accepts the layout `forest_attention` builds, and names each operand
    that would make the kernel read or write outside it."""
    rows, nh, nkv, hd, pad = 5, 4, 2, cutlass_gemm.FMHA_HEAD_DIM, cutlass_gemm.FMHA_TILE_ROWS
    bf = torch.bfloat16

    def operands() -> dict[str, torch.Tensor]:
        return {
            "q": torch.zeros(rows + pad, nh, hd, dtype=bf)[:rows],  # padding rows in its storage
            "k": torch.zeros(rows + pad, nkv, hd, dtype=bf),
            "v": torch.zeros(rows + pad, nkv, hd, dtype=bf),
            "out": torch.zeros(rows, nh, hd),
            "lse": torch.zeros(rows, nh),
            "tiles": torch.zeros(3, 4, dtype=torch.int32),
            "count": torch.zeros(1, dtype=torch.int32),
        }

    cutlass_gemm.check_forest_fmha_operands(**operands(), rows=rows)
    broken = {
        "q": torch.zeros(rows, nh, hd, dtype=bf),  # no padding rows behind it
        "k": torch.zeros(rows + pad - 1, nkv, hd, dtype=bf),
        "v": torch.zeros(rows + pad, nkv, hd),  # fp32
        "out": torch.zeros(rows, nh, hd, dtype=bf),
        "lse": torch.zeros(rows, nh + 1),
        "tiles": torch.zeros(3, 4, dtype=torch.int64),
        "count": torch.zeros(2, dtype=torch.int32),
    }
    for name, bad in broken.items():
        with pytest.raises(ValueError, match=rf"forest FMHA: {name}\b|{name} and"):
            cutlass_gemm.check_forest_fmha_operands(**{**operands(), name: bad}, rows=rows)
    with pytest.raises(ValueError, match="head dim"):
        q = torch.zeros(rows + pad, nh, 128, dtype=bf)[:rows]
        cutlass_gemm.check_forest_fmha_operands(**{**operands(), "q": q}, rows=rows)
    with pytest.raises(ValueError, match="k and v"):  # 3 KV heads do not divide 4 query heads
        kv3 = torch.zeros(rows + pad, 3, hd, dtype=bf)
        cutlass_gemm.check_forest_fmha_operands(**{**operands(), "k": kv3, "v": kv3}, rows=rows)


def test_the_fmha_binding_matches_the_c_signature() -> None:
    """`Library.forest_fmha` binds `prism_forest_fmha` through ctypes, which cannot see the C
    signature: a parameter added on one side only would pass the stream where an int is read, or
    an int where the stream is. The header's parameter types, read as text (CI builds no CUDA),
    must be `FOREST_FMHA_ARGTYPES` one for one: pointers as c_void_p, ints as c_int."""
    import re

    text = cutlass_gemm.FMHA_HEADER.read_text()
    found = re.search(r'extern "C" int prism_forest_fmha\(([^)]*)\)', text)
    assert found is not None
    params = [" ".join(p.split()) for p in found.group(1).split(",")]
    kinds = [ctypes.c_void_p if ("*" in p or p.startswith("cudaStream_t")) else ctypes.c_int for p in params]
    assert all(p.startswith("int ") for p, k in zip(params, kinds, strict=True) if k is ctypes.c_int)
    assert tuple(kinds) == cutlass_gemm.FOREST_FMHA_ARGTYPES


def _toolchain() -> bool:
    try:
        cutlass_gemm._nvcc()
        cutlass_gemm._cutlass_include()
    except FileNotFoundError:
        return False
    return shutil.which("g++") is not None or shutil.which("c++") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _toolchain(), reason="needs nvcc and CUTLASS's headers (make cutlass)")
def test_a_build_exports_what_the_loader_binds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real build links every symbol `Library` binds; a second build whose FMHA header differs
    compiles that one unit again and takes the GEMM's object from the kept ones (`build`'s
    objects), and still exports everything."""
    one = (CutlassConfig(64, 128, 128, "pingpong"),)
    objects = tmp_path / "objects"
    name = cutlass_gemm.LIBRARY_NAME
    lib_path = cutlass_gemm.build(tmp_path / "lib" / name, jobs=1, configs=one, objects=objects)
    lib = ctypes.CDLL(str(lib_path))  # static cudart: loads without a GPU
    assert hasattr(lib, "prism_int8_gemm_p64x128x128")
    assert hasattr(lib, "prism_int8_gemm_p64x128x128_workspace")
    assert hasattr(lib, "prism_int8_gemm_swiglu_pairs_p64x128x128")
    assert hasattr(lib, "prism_forest_fmha")
    assert cutlass_gemm.build(lib_path, configs=one) == lib_path  # built once
    kept = sorted(o.name.split("-")[0] for o in objects.glob("*.o"))
    assert kept == [cutlass_gemm.FMHA_UNIT, "p64x128x128"]

    edited = tmp_path / "edited" / cutlass_gemm.FMHA_HEADER.name
    edited.parent.mkdir()
    edited.write_text(cutlass_gemm.FMHA_HEADER.read_text() + "// an edit\n")
    monkeypatch.setattr(cutlass_gemm, "FMHA_HEADER", edited)
    compiled: list[str] = []
    real_run = subprocess.run

    def run(cmd: list[str], *args: object, **kwargs: object) -> subprocess.CompletedProcess:
        if "-c" in cmd:
            compiled.append(Path(cmd[cmd.index("-o") + 1]).stem)
        return real_run(cmd, *args, **kwargs)  # type: ignore[call-overload, no-any-return]

    monkeypatch.setattr(cutlass_gemm.subprocess, "run", run)
    again = cutlass_gemm.build(tmp_path / "again" / name, jobs=1, configs=one, objects=objects)
    assert compiled == [cutlass_gemm.FMHA_UNIT]
    lib = ctypes.CDLL(str(again))
    assert hasattr(lib, "prism_int8_gemm_p64x128x128") and hasattr(lib, "prism_forest_fmha")
    assert len(list(objects.glob("*.o"))) == 3


def test_a_units_object_is_named_by_everything_that_went_into_it(tmp_path: Path) -> None:
    """`_unit_key`, which names a kept object: the same source, header text and command give the
    same key (another build folder does not enter it), and any one of them changed gives another."""
    header = tmp_path / "h.cuh"
    header.write_text("// one\n")
    command = ["nvcc", "-O3", "-fmad=false"]
    key = cutlass_gemm._unit_key("#include h\n", header, command)
    assert cutlass_gemm._unit_key("#include h\n", header, list(command)) == key
    assert cutlass_gemm._unit_key("#include h \n", header, command) != key
    assert cutlass_gemm._unit_key("#include h\n", header, ["nvcc", "-O2", "-fmad=false"]) != key
    header.write_text("// two\n")
    assert cutlass_gemm._unit_key("#include h\n", header, command) != key


def test_the_build_finds_cutlass_from_its_wheel_or_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def includes(root: Path) -> list[Path]:  # the headers, then the FMHA example's folder
        return [root / "include", root / "tools" / "util" / "include", root / "examples" / "88_hopper_fmha"]

    monkeypatch.setenv("CUTLASS_HOME", str(tmp_path))
    assert cutlass_gemm._cutlass_include() == includes(tmp_path)
    monkeypatch.delenv("CUTLASS_HOME")
    toolchain = tmp_path / "toolchain"
    monkeypatch.setattr(cutlass_gemm, "TOOLCHAIN", toolchain)
    if importlib.util.find_spec("cutlass_library") is None:
        with pytest.raises(FileNotFoundError, match="CUTLASS"):
            cutlass_gemm._cutlass_include()
    # `make cutlass` unpacks the wheel into the toolchain folder, which is searched before sys.path
    source = toolchain / "cutlass_library" / "source"
    (source / "include").mkdir(parents=True)
    assert cutlass_gemm._cutlass_include() == includes(source)


def test_the_toolchain_is_unpacked_apart_from_the_venv(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """pip runs with --target and --no-deps (resolving the wheels' CUDA pins against the venv once
    replaced its torch), and only once per list of wheels."""
    calls: list[list[str]] = []

    def pip(cmd: list[str], **_: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cutlass_gemm.subprocess, "run", pip)
    assert cutlass_gemm.install_toolchain(tmp_path) == tmp_path
    (cmd,) = calls
    assert cmd[cmd.index("--target") + 1] == str(tmp_path) and "--no-deps" in cmd
    assert cmd[-len(cutlass_gemm.TOOLCHAIN_WHEELS) :] == list(cutlass_gemm.TOOLCHAIN_WHEELS)
    cutlass_gemm.install_toolchain(tmp_path)
    assert len(calls) == 1


# --- on an sm_90 GPU with the library ------------------------------------------------------------

SHAPES = [(1, 256, 128), (17, 1024, 256), (200, 520, 384), (256, 5120, 1024), (1000, 1028, 2048)]


@needs_library
@pytest.mark.parametrize("config", [c.name for c in CONFIGS])
@pytest.mark.parametrize("residual", [False, True])
def test_every_config_gives_the_reference_bits(config: str, residual: bool) -> None:
    assert LIBRARY is not None
    for i, (m, n, k) in enumerate(SHAPES):
        a, w, a_scale, w_scale, res = _cuda(*_operands(m, n, k, 10 + i, residual))
        y = torch.empty(m, n, device="cuda")
        LIBRARY.gemm(config, a, w, a_scale, w_scale, res, y)
        want = int8_gemm_reference(a, w, a_scale, w_scale, res)
        assert torch.equal(y, want), (config, m, n, k)


@needs_library
@pytest.mark.parametrize("config", [c.name for c in CONFIGS])
def test_a_row_has_the_same_bits_alone_and_anywhere_in_a_batch(config: str) -> None:
    assert LIBRARY is not None
    m, n, k = 300, 1024, 512
    a, w, a_scale, w_scale, res = _cuda(*_operands(m, n, k, 3, True))
    whole = torch.empty(m, n, device="cuda")
    LIBRARY.gemm(config, a, w, a_scale, w_scale, res, whole)
    for row in (0, 131, 299):
        alone = torch.empty(1, n, device="cuda")
        LIBRARY.gemm(config, a[row : row + 1], w, a_scale[row : row + 1], w_scale, res[row : row + 1], alone)
        assert torch.equal(alone[0], whole[row])
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(4)).cuda()
    shuffled = torch.empty(m, n, device="cuda")
    LIBRARY.gemm(config, a[perm].contiguous(), w, a_scale[perm], w_scale, res[perm].contiguous(), shuffled)
    assert torch.equal(shuffled, whole[perm])


@needs_library
def test_int8_gemm_hands_the_table_buckets_to_it_with_the_triton_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    real = cutlass_gemm.Library.gemm
    monkeypatch.setattr(
        cutlass_gemm.Library,
        "gemm",
        lambda self, name, *args: (calls.append(name), real(self, name, *args))[1],
    )
    for m in (16, 64, 65, 384, 3000):
        a, w, a_scale, w_scale, res = _cuda(*_operands(m, 1024, 512, m, True))
        calls.clear()
        got = int8_gemm(a, w, a_scale, w_scale, res)
        want = config_for(m, 1024, torch.cuda.get_device_properties(0).multi_processor_count)
        assert calls == ([want] if want else [])
        assert torch.equal(got, int8_gemm(a, w, a_scale, w_scale, res, backend="triton"))


@needs_library
def test_a_captured_graph_replays_it() -> None:
    """The ctypes call launches on torch's current stream, so a CUDA graph records it."""
    assert LIBRARY is not None
    name = CONFIGS[0].name
    a, w, a_scale, w_scale, res = _cuda(*_operands(256, 1024, 512, 7, True))
    y = torch.empty(256, 1024, device="cuda")
    LIBRARY.gemm(name, a, w, a_scale, w_scale, res, y)  # workspace allocated outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        LIBRARY.gemm(name, a, w, a_scale, w_scale, res, y)
    y.zero_()
    a2, _, s2, _, r2 = _cuda(*_operands(256, 1024, 512, 8, True))
    a.copy_(a2)
    a_scale.copy_(s2)
    res.copy_(r2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, int8_gemm_reference(a, w, a_scale, w_scale, res))


def _pairs(m: int, i: int, k: int, seed: int, gate_scale: float = 1.0):
    """Operands of the MLP's gate+up in its stored layout: w [2I, K], row 2j gate j and row 2j + 1
    up j. gate_scale widens the gate values (x 40 reaches |g| of ~100: exp(-g) overflows to inf, or
    g / (1 + exp(-g)) -> 0)."""
    a, w, a_scale, w_scale, _ = _operands(m, 2 * i, k, seed, False)
    w_scale[0::2] *= gate_scale
    return _cuda(a, w, a_scale, w_scale)


def _divisor(i: int, seed: int) -> torch.Tensor:
    """A SmoothQuant divisor of ffn_down's input: per-feature, 0.25-4, some exactly 1."""
    gen = torch.Generator().manual_seed(seed)
    div = torch.exp2(torch.rand(i, generator=gen) * 4 - 2)
    div[::7] = 1.0
    return div.cuda() if ON_HOPPER else div


def _spy_pairs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The (config, weight rows) of every `Library.swiglu_pairs` launch from now on."""
    calls: list[tuple[str, int]] = []
    real = cutlass_gemm.Library.swiglu_pairs

    def spy(self, name, a, w, *args):  # noqa: ANN001, ANN202
        calls.append((name, w.shape[0]))
        return real(self, name, a, w, *args)

    monkeypatch.setattr(cutlass_gemm.Library, "swiglu_pairs", spy)
    return calls


@needs_library
@pytest.mark.parametrize("config", [c.name for c in CONFIGS])
@pytest.mark.parametrize("gate_scale", [1.0, 40.0])
def test_the_one_gemm_swiglu_gives_the_triton_fused_kernels_bits(config: str, gate_scale: float) -> None:
    """v = silu(g) * u paired in the epilogue of one GEMM over the interleaved weight equals the
    Triton fused kernel's v bit for bit: the same g and u, the same instructions after them.
    Widths that are not a multiple of the tile (I = 520) check that the last tile's columns past
    N are neither paired nor stored (v starts as NaN: every value must be written)."""
    assert LIBRARY is not None
    for j, (m, i, k) in enumerate([(65, 512, 256), (256, 1024, 512), (300, 2048, 1024), (1000, 520, 384)]):
        a, w, a_scale, w_scale = _pairs(m, i, k, 80 + j, gate_scale)
        v = torch.full((m, i), float("nan"), device="cuda")
        LIBRARY.swiglu_pairs(config, a, w, a_scale, w_scale, v)
        want = int8_gemm_swiglu(a, w, a_scale, w_scale, backend="triton")
        assert torch.equal(v, want), (config, m, i, k)
        assert bool(torch.isfinite(v).all())


@needs_library
@pytest.mark.parametrize("swizzle", [True, False])
def test_int8_gemm_swiglu_hands_the_table_buckets_to_it_and_a_row_keeps_its_bits(
    monkeypatch: pytest.MonkeyPatch, swizzle: bool
) -> None:
    """From `cutlass_gemm.SWIGLU_MIN_ROWS` (0 here), `int8_gemm_swiglu` runs the one CUTLASS GEMM
    where the table names a config for the interleaved weight (at 3,000 rows of 16,896 outputs the
    clustered tile, or the swizzled one with SWIGLU_SWIZZLE) and Triton's kernel elsewhere; a row's
    v is the same alone (M = 1, Triton) and inside any batch. Below it, Triton's."""
    monkeypatch.setattr(cutlass_gemm, "SWIGLU_MIN_ROWS", 0)
    monkeypatch.setattr(cutlass_gemm, "SWIGLU_SWIZZLE", swizzle)
    calls = _spy_pairs(monkeypatch)
    i, k = 8448, 512
    a, w, a_scale, w_scale = _pairs(3000, i, k, 5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (16, 64, 65, 384, 3000):
        calls.clear()
        got = int8_gemm_swiglu(a[:m], w, a_scale[:m], w_scale)
        name = config_for(m, 2 * i, sms)
        assert calls == ([(cutlass_gemm.swiglu_config(name), 2 * i)] if name else [])
        if m == 3000:
            assert name == TABLE[-1][1]
            assert calls[0][0] == (cutlass_gemm.SWIZZLED_TILE if swizzle else name)
        for row in (0, m // 2, m - 1):
            alone = int8_gemm_swiglu(a[row : row + 1], w, a_scale[row : row + 1], w_scale)
            assert torch.equal(alone[0], got[row]), (m, row)
    monkeypatch.setattr(cutlass_gemm, "SWIGLU_MIN_ROWS", 385)
    calls.clear()
    int8_gemm_swiglu(a[:384], w, a_scale[:384], w_scale)
    assert calls == []


@needs_library
@pytest.mark.parametrize("m", [100, 257, 384, 3000])
def test_the_mlps_quantized_v_has_the_unfused_paths_bits(monkeypatch: pytest.MonkeyPatch, m: int) -> None:
    """`int8_gemm_swiglu_quantize` on the one-GEMM form equals the unfused path (the plain GEMM
    over the interleaved weight, then `swiglu_quantize` on its even and odd columns) bit for bit,
    codes and scales, with a divisor and without; a row alone (M = 1: Triton's fused kernel and
    `quantize_rows`) keeps its codes; a graph captured after a first call replays the same bits."""
    from engine.kernels.decode_quant import swiglu_quantize
    from engine.kernels.int8_gemm import int8_gemm_swiglu_quantize

    calls = _spy_pairs(monkeypatch)
    i, k = 4352, 1024
    a, w, a_scale, w_scale = _pairs(m, i, k, 9)
    div = _divisor(i, 3)
    y = int8_gemm(a, w, a_scale, w_scale)
    for d in (div, None):
        want_q, want_s = swiglu_quantize(y, d)
        q, scale = int8_gemm_swiglu_quantize(a, w, a_scale, w_scale, d)
        assert torch.equal(scale, want_s) and torch.equal(q, want_q)
    assert len(calls) == 2
    want_q, want_s = swiglu_quantize(y, div)
    for row in (0, m - 1):
        one = slice(row, row + 1)
        alone_q, alone_s = int8_gemm_swiglu_quantize(a[one], w, a_scale[one], w_scale, div)
        assert torch.equal(alone_q[0], want_q[row]) and torch.equal(alone_s[0], want_s[row])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_graph, s_graph = int8_gemm_swiglu_quantize(a, w, a_scale, w_scale, div)
    q_graph.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_graph, want_q) and torch.equal(s_graph, want_s)


def test_the_mlps_quantized_v_is_quantize_rows_of_v_without_the_library() -> None:
    """Where no CUTLASS library serves (CPU here), `int8_gemm_swiglu_quantize` is the fused
    SwiGLU then `quantize_rows`: oracle, the torch references of both."""
    from engine.kernels.int8_gemm import int8_gemm_swiglu_quantize, int8_gemm_swiglu_reference
    from engine.kernels.quant import quantize_rows_reference

    a, w, a_scale, w_scale, _ = _operands(300, 2 * 520, 384, 11, False)
    div = _divisor(520, 5).cpu()
    want_q, want_s = quantize_rows_reference(int8_gemm_swiglu_reference(a, w, a_scale, w_scale), div)
    q, scale = int8_gemm_swiglu_quantize(a, w, a_scale, w_scale, div)
    assert torch.equal(scale, want_s) and torch.equal(q, want_q)
    q_none, s_none = int8_gemm_swiglu_quantize(a, w, a_scale, w_scale, None)
    want_q, want_s = quantize_rows_reference(int8_gemm_swiglu_reference(a, w, a_scale, w_scale))
    assert torch.equal(s_none, want_s) and torch.equal(q_none, want_q)
    with pytest.raises(ValueError, match=r"the divisor must be \[520\]"):
        int8_gemm_swiglu_quantize(a, w, a_scale, w_scale, div[:-4])


def test_the_mlp_runs_unfused_where_cutlass_serves_the_stacked_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """`swiglu_fused` (speed alone: both forms give the same bits): SWIGLU_TABLE's choice where
    Triton runs the GEMMs; where CUTLASS serves M, its one-GEMM SwiGLU from SWIGLU_MIN_ROWS rows
    and the stacked GEMM and `swiglu_quantize` below."""
    from engine.kernels.int8_gemm import swiglu_config_for, swiglu_fused

    w = torch.zeros(2 * 1024, 512, dtype=torch.int8)
    for m in (1, 16, 64, 65, 384, 3000):
        assert swiglu_fused(m, w) == (swiglu_config_for(m) is not None)  # CPU: no CUTLASS
    monkeypatch.setattr(cutlass_gemm, "library", lambda: object())  # as if built: the rules alone
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(cutlass_gemm, "_sm_count", lambda device: 132)
    for m in (1, 16, 64, 65, 384, 3000):
        served = config_for(m) is not None
        one_gemm = m >= cutlass_gemm.SWIGLU_MIN_ROWS
        assert swiglu_fused(m, w) == (swiglu_config_for(m) is not None and (not served or one_gemm)), m
    monkeypatch.setattr(cutlass_gemm, "SWIGLU_MIN_ROWS", 1 << 62)
    assert not swiglu_fused(384, w) and not swiglu_fused(3000, w)
    monkeypatch.setattr(cutlass_gemm, "SWIGLU_MIN_ROWS", 0)
    assert swiglu_fused(65, w) == (swiglu_config_for(65) is not None)
