"""Row quantization kernels: bit-equal to torch (plain), ~1 ulp (fused norm), batch invariant."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.quant import (
    quantize_rows,
    quantize_rows_reference,
    rms_norm_fp32,
    rms_norm_quantize,
    rms_norm_quantize_reference,
)

ON_CUDA = torch.cuda.is_available()
EPS = 1e-6


def _rows(gen: torch.Generator, m: int, k: int, dev: torch.device, dtype: torch.dtype = torch.float32):
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]
    x[:, ::17] *= 20  # outlier channels, as SmoothQuant sees them
    return x.to(dtype).to(dev)


def test_reference_rounds_half_to_even_and_clamps() -> None:
    # absmax 127 -> scale exactly 1, so x / scale hits exact .5 ties
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -126.5]])
    q, scale = quantize_rows_reference(x)
    assert scale.tolist() == [1.0]
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 3, -126]]
    q0, s0 = quantize_rows_reference(torch.zeros(2, 8))
    assert s0.tolist() == [0.0, 0.0] and not q0.any()


def test_reference_reconstructs_within_half_a_step(gen: torch.Generator) -> None:
    x = _rows(gen, 6, 96, torch.device("cpu"))
    q, scale = quantize_rows_reference(x)
    assert torch.all((q.float() * scale[:, None] - x).abs() <= scale[:, None] * 0.5 * (1 + 1e-5))
    assert torch.all(q.abs().amax(-1) == 127)


@pytest.mark.parametrize("k", [40, 5000])  # 5000 > one 4096 block: the chunked loops
@pytest.mark.parametrize("with_divisor", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_kernel_equals_reference(
    gen: torch.Generator, dev: torch.device, k: int, with_divisor: bool, dtype: torch.dtype
) -> None:
    # on CUDA enough rows that a 1-ulp scale difference (as torch's division by a Python
    # scalar gives there) would show; the interpreter keeps it small
    x = _rows(gen, 512 if ON_CUDA else 5, k, dev, dtype)
    x[1, :9] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -4.5], dtype=dtype)
    x[1, 9:] = 0.25  # row 1: absmax 127, exact ties
    x[3] = 0.0  # an all-zero row
    div = (torch.rand(k, generator=gen) + 0.5).to(dev) if with_divisor else None
    if with_divisor:
        div[:9] = 1.0
    q, scale = quantize_rows(x, div, backend="triton")
    q_ref, s_ref = quantize_rows_reference(x, div)
    assert torch.equal(scale, s_ref)
    assert torch.equal(q, q_ref)


def test_rms_norm_quantize_close_to_reference(gen: torch.Generator, dev: torch.device) -> None:
    m, k = (256, 5120) if ON_CUDA else (6, 300)
    x = _rows(gen, m, k, dev)
    w = (torch.rand(k, generator=gen) + 0.5).to(dev)
    q, scale = rms_norm_quantize(x, w, EPS, backend="triton")
    q_ref, s_ref = rms_norm_quantize_reference(x, w, EPS)
    assert torch.allclose(scale, s_ref, rtol=1e-6, atol=0)
    # the norm's sum of squares is reduced in another order: values agree to ~1 ulp, so a
    # quantized value may sit on the other side of a rounding boundary, never further
    assert int((q.int() - q_ref.int()).abs().max()) <= 1
    assert (q == q_ref).float().mean().item() >= 0.999
    # and against an fp64 oracle of the normed values
    normed = rms_norm_fp32(x.double(), w.double(), EPS)
    assert torch.all((q.double() * scale[:, None].double() - normed).abs() <= scale[:, None] * 0.5 + 1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_rows_do_not_depend_on_batch(gen: torch.Generator, dev: torch.device, fused: bool) -> None:
    m, k = (1000, 5120) if ON_CUDA else (9, 300)
    x = _rows(gen, m, k, dev)
    w = (torch.rand(k, generator=gen) + 0.5).to(dev)

    def run(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if fused:
            return rms_norm_quantize(rows, w, EPS, backend="triton")
        return quantize_rows(rows, w, backend="triton")

    q_all, s_all = run(x)
    for lo, hi in [(0, 1), (2, 5), (m - 3, m)]:
        q, s = run(x[lo:hi].clone())
        assert torch.equal(q, q_all[lo:hi]) and torch.equal(s, s_all[lo:hi])


def test_bad_inputs_are_named(dev: torch.device) -> None:
    x = torch.ones(3, 8, device=dev)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        quantize_rows(x[0])
    with pytest.raises(ValueError, match="per-channel vector"):
        quantize_rows(x, torch.ones(7, device=dev))
    with pytest.raises(ValueError, match="float32/bfloat16"):
        quantize_rows(x.int())
    with pytest.raises(ValueError, match="eps"):
        rms_norm_quantize(x, torch.ones(8, device=dev), 0.0)


# ------------------------------------------------------------------ resident rows == passes
@pytest.mark.parametrize("k", [40, 300, 2560, 5000, 6144])  # one block .. two of 4,096, ragged ends
@pytest.mark.parametrize("mode", ["plain", "divisor", "norm"])
def test_resident_kernel_equals_the_passes_kernel(
    gen: torch.Generator, dev: torch.device, monkeypatch: pytest.MonkeyPatch, k: int, mode: str
) -> None:
    """The row kept in registers gives the bits of the shipped three-pass kernel: the plain
    quantizers, and the fused norm, whose sum of squares must be reduced in the same order."""
    import engine.kernels.quant as kq

    m = 64 if ON_CUDA else 4
    x = _rows(gen, m, k, dev, torch.bfloat16 if k == 300 else torch.float32)
    x[1] = 0.0  # an all-zero row: scale 0, q 0
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -4.5])
    x[2, :9] = ties.to(x.dtype)  # absmax 127: exact ties
    vec = (torch.rand(k, generator=gen) + 0.5).to(dev)
    assert kq.resident_blocking(k, mode == "norm") is not None

    def run(variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(kq, "VARIANT", variant)
        if mode == "norm":
            return rms_norm_quantize(x, vec, EPS, backend="triton")
        return quantize_rows(x, vec if mode == "divisor" else None, backend="triton")

    q_new, s_new = run("resident")
    q_old, s_old = run("passes")
    assert torch.equal(s_new, s_old) and torch.equal(q_new, q_old)
    if mode != "norm":  # and the torch reference's, which the plain quantization equals
        q_ref, s_ref = quantize_rows_reference(x, vec if mode == "divisor" else None)
        assert torch.equal(s_new, s_ref) and torch.equal(q_new, q_ref)
    # a row alone: the same bits as among the others
    q1, s1 = (
        rms_norm_quantize(x[m - 1 :].clone(), vec, EPS, backend="triton")
        if mode == "norm"
        else quantize_rows(x[m - 1 :].clone(), vec if mode == "divisor" else None, backend="triton")
    )
    assert torch.equal(q1, q_new[m - 1 :]) and torch.equal(s1, s_new[m - 1 :])


def test_resident_blocking_keeps_the_norms_block_and_fits_rows() -> None:
    from engine.kernels.quant import MAX_BLOCK, RESIDENT_VALUES, resident_blocking

    for k in (16, 40, 300, 2560, 4096, 5000, 5120, 6144, 8192, 10240, 12288, 17408, 40000):
        for norm in (False, True):
            got = resident_blocking(k, norm)
            if got is None:
                assert norm or k > 16 * 32 * RESIDENT_VALUES, k
                continue
            block, warps = got
            if norm:  # the passes kernel's block and warps: the sum's order depends on them
                assert block == min(1 << (k - 1).bit_length(), MAX_BLOCK)
                assert warps == (8 if block >= 2048 else 4)
            assert -(-k // block) * block <= RESIDENT_VALUES * 32 * warps
    assert resident_blocking(6144, False) == (2048, 8)  # 3 full blocks, not 2 x 4,096
    assert resident_blocking(5120, True) == (4096, 8)


_LAYOUTS = r"""
import glob, json, os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
import engine.kernels.norm as kn
import engine.kernels.quant as kq
from engine.kernels.aot import compile_launch, record

kq.VARIANT = kn.VARIANT = sys.argv[1]
with record() as launches:
    for k in (1000, 2560, 5120):  # blocks of 1,024 (4 warps) and 4,096 (8 warps), one or two of them
        kq.rms_norm_quantize(torch.zeros(4, k), torch.zeros(k), 1e-6, backend="triton")
        kn.norm_rows(torch.zeros(4, k), torch.zeros(k), 1e-6, backend="triton")
        kn.norm_rows(torch.zeros(4, k), None, 1e-6, mean=False, backend="triton")
for launch in launches:
    compile_launch(launch)
sums = set()
for path in glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "*.ttgir")):
    text = open(path).read()
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{.*\}>)", text, re.M))
    for body in text.split('"tt.reduce"(')[1:]:
        region, _, rest = body.partition("}) : (")
        operand = rest.split(")", 1)[0]  # e.g. tensor<4096xf32, #blocked>
        shape, layout = operand.removeprefix("tensor<").removesuffix(">").split(", ")
        if "arith.addf" in region:  # keyed by family: _quant_row/_quant_resident, _norm_row/_norm_resident
            family = os.path.basename(path).split("_")[1]
            sums.add(family + " " + shape + " " + aliases.get(layout, layout))
print(json.dumps(sorted(sums)))
"""


@pytest.mark.slow
def test_resident_norms_reduce_over_the_shipped_layouts(tmp_path) -> None:  # noqa: ANN001
    """Compiled for sm_90 (no GPU needed), the resident norm kernels' sums of squares reduce
    tensors of the same shapes in the same layouts as the passes kernels': the lowering of
    `tl.sum` (per-thread order, shuffles, cross-warp step) follows from those alone, and the
    lanes hold the same values, so the sums are the same bits on the GPU too."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    repo = Path(__file__).resolve().parents[3]
    got = {}
    for variant in ("passes", "resident"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(tmp_path / variant)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)
        run = subprocess.run(
            [sys.executable, "-c", _LAYOUTS, variant], cwd=repo, env=env, capture_output=True, text=True,
            timeout=900,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        got[variant] = run.stdout.strip().splitlines()[-1]
    assert all(f"{f} {n}xf32" in got["passes"] for f in ("quant", "norm") for n in (1024, 4096)), got
    assert got["resident"] == got["passes"], got
