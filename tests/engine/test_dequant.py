"""engine.model.dequant against gguf-py's numpy reference (bitwise), and the generator's K-quantisers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from engine.model.dequant import SUPPORTED_TYPES, UnsupportedTypeError, dequantize
from engine.testing.make_model import quantize, quantize_q4_k, quantize_q6_k

# Byte offsets of the fp16 scale fields inside one block; random bytes there could be NaN/Inf.
FP16_FIELDS: dict[Q, list[int]] = {
    Q.Q8_0: [0],
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes with finite fp16 scales (everything else arbitrary)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    if qtype == Q.F16:
        return rng.normal(0, 100, (n_blocks,)).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if qtype == Q.F32:
        return rng.normal(0, 100, (n_blocks,)).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    if qtype == Q.BF16:  # keep exponents off all-ones: no NaN/Inf
        raw[:, 1] &= 0x7E
    for off in FP16_FIELDS.get(qtype, []):
        raw[:, off : off + 2] = rng.normal(0, 1, (n_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw


def test_every_listed_type_is_supported() -> None:
    assert set(TYPES) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dequantize_is_bitwise_equal_to_gguf_py(qtype: Q, seed: int) -> None:
    rng = np.random.default_rng(seed)
    block, _ = GGML_QUANT_SIZES[qtype]
    rows = 7
    per_row = int(rng.integers(1, 9))
    raw = random_blocks(qtype, rows * per_row, rng).reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, qtype)
    got = dequantize(raw, qtype, (rows, per_row * block))
    assert got.dtype == torch.float32
    assert got.shape == (rows, per_row * block)
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


def test_dequantize_accepts_torch_bytes_and_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked decoding (forced tiny chunks) gives the same bits as the reference."""
    import engine.model.dequant as dq

    monkeypatch.setattr(dq, "CHUNK_ELEMENTS", 512)
    raw = random_blocks(Q.Q6_K, 11, np.random.default_rng(5))
    got = dequantize(torch.from_numpy(raw.reshape(-1)), Q.Q6_K, (11 * 256,))
    assert np.array_equal(
        got.numpy().view(np.uint32), gguf.quants.dequantize(raw, Q.Q6_K).reshape(-1).view(np.uint32)
    )


def test_dequantize_rejects_bad_input() -> None:
    raw = np.zeros(34, dtype=np.uint8)
    with pytest.raises(UnsupportedTypeError, match="Q2_K"):
        dequantize(np.zeros(84, dtype=np.uint8), Q.Q2_K, (256,))
    with pytest.raises(ValueError, match="needs 68 bytes, got 34"):
        dequantize(raw, Q.Q8_0, (64,))
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize(raw, Q.Q8_0, (33,))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_generator_k_quantisers_decode_close_to_input(qtype: Q) -> None:
    """The plain Q4_K/Q6_K encoders give valid blocks: gguf-py decodes them to within about one
    quantisation step of the input (step = sub-block range / levels)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 512)).astype(np.float32) * rng.uniform(0.01, 10, (64, 1)).astype(np.float32)
    data = quantize(x, qtype)
    assert data.dtype == np.uint8 and data.shape == (64, 2 * GGML_QUANT_SIZES[qtype][1])
    back = gguf.quants.dequantize(data, qtype)
    if qtype == Q.Q6_K:
        sub = x.reshape(-1, 16)
        step = np.abs(sub).max(-1, keepdims=True) / 31  # levels -31..31 over [-max, max]
    else:
        sub = x.reshape(-1, 32)
        step = (sub.max(-1, keepdims=True) - np.minimum(sub.min(-1, keepdims=True), 0)) / 15
    err = np.abs(back.reshape(sub.shape) - sub)
    # Half a step from rounding, plus the 6-bit sub-scale (and min) rounding spread over 15-31 levels.
    assert (err <= 0.5 * step + 0.25 * step + 1e-6).all(), float((err / step).max())


def test_k_quantisers_handle_all_zero_blocks() -> None:
    zeros = np.zeros((2, 256), dtype=np.float32)
    for enc, qtype in ((quantize_q4_k, Q.Q4_K), (quantize_q6_k, Q.Q6_K)):
        back = gguf.quants.dequantize(enc(zeros), qtype)
        assert np.array_equal(back, zeros)
