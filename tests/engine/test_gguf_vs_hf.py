"""Engine I: `Engine.load(gguf).logits` against HF transformers' `Qwen3_5ForCausalLM`.

The oracle never goes through the engine's GGUF reader, dequantiser or loader:

- F32: HF is built from `canonical_random_weights(config, seed)`, the tensors the generator
  drew *before* it applied the converter's transforms (value-head tiling, conv squeeze) and
  wrote the file. The engine side reads the file and must undo those transforms itself.
- Q8_0 / Q4_K_M: HF is built from the same canonical tensors pushed through what the file
  holds: tiled like the converter does (`tile_v_heads`), encoded with the generator's per-tensor
  plan (`tensor_types` + `quantize`, which is exactly what `write_gguf` stored), decoded by
  gguf-py's `gguf.quants.dequantize` (not `engine.model.dequant`), then un-tiled by tracking where
  each index went (not the loader's permutation). Tiling must happen before quantising:
  `ssm_out`'s tiled columns move in blocks of `linear_value_head_dim` (16 on tiny), smaller
  than a quant block (32), so quantising in canonical order would give different weights.

Metric (as in test_reference): per position, max|engine - hf| / max|hf| over the full
248,320-row vocabulary; every position of every sequence must be <= 1e-4.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.engine import Engine
from engine.model.gguf import open_gguf
from engine.model.loader import tensor_name
from engine.model.weights import Weights
from engine.testing.hf import to_hf_model
from engine.testing.make_model import quantize, tensor_types, tile_v_heads

MAX_REL_ERR = 1e-4
SEQUENCES = 20
MAX_LEN = 512
# Edges of the GDN chunking and of the conv window, plus the longest allowed length.
FIXED_LENGTHS = [1, 2, 3, 4, 5, 63, 64, 65, 511, 512]


def sequence_lengths(seed: int) -> list[int]:
    """FIXED_LENGTHS plus log-uniform lengths in [6, 512]: mostly short, some long."""
    rng = np.random.default_rng(seed)
    extra = np.exp(rng.uniform(math.log(6), math.log(MAX_LEN), SEQUENCES - len(FIXED_LENGTHS)))
    return FIXED_LENGTHS + [int(n) for n in extra]


def untile(config, key: str, stored: torch.Tensor) -> torch.Tensor:
    """Invert `tile_v_heads` by tagging every index and reading where it landed."""
    axis = 1 if key == "ssm_out" else 0
    n = stored.shape[axis]
    tags = torch.arange(n, dtype=torch.float64)
    if stored.dim() == 1:
        where = tile_v_heads(config, key, tags)
    elif axis == 1:
        where = tile_v_heads(config, key, tags[None, :].expand(2, n))[0]
    else:
        where = tile_v_heads(config, key, tags[:, None].expand(n, 2))[:, 0]
    inverse = torch.empty(n, dtype=torch.long)
    inverse[where.long()] = torch.arange(n)
    return stored.index_select(axis, inverse)


def dequantized_canonical(weights: Weights, quant: str) -> Weights:
    """What a `quant` file holds, decoded by gguf-py, in canonical layout (see module docstring)."""
    c = weights.config
    types = tensor_types(c, quant)

    def through(name: str, key: str, t: torch.Tensor, layered: bool) -> torch.Tensor:
        stored = tile_v_heads(c, key, t) if layered else t
        qtype = types[name]
        data = quantize(stored.numpy(), qtype)
        back = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))
        back = back.reshape(stored.shape)
        return untile(c, key, back) if layered else back

    embd = through("token_embd.weight", "token_embd", weights.token_embd, False)
    return Weights(
        config=c,
        token_embd=embd,
        output_norm=through("output_norm.weight", "output_norm", weights.output_norm, False),
        output=embd if c.tied_embeddings else through("output.weight", "output", weights.output, False),
        layers=[
            {k: through(tensor_name(i, k), k, t, True) for k, t in layer.items()}
            for i, layer in enumerate(weights.layers)
        ],
    )


def worst_relative_error(engine: Engine, hf, lengths: list[int], seed: int) -> list[float]:
    """Worst per-position relative error of each random sequence (full-vocabulary token ids)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    worst = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        ours = engine.logits(ids)
        assert ours.shape == (n, vocab) and ours.dtype == torch.float32
        with torch.no_grad():
            ref = hf(input_ids=ids[None], use_cache=False).logits[0].float()
        err = (ours - ref).abs().amax(-1) / ref.abs().amax(-1)
        assert bool(torch.isfinite(err).all())
        worst.append(float(err.max()))
        del ours, ref
    return worst


def check_against_hf(
    loaded_engine: Callable[..., Engine], oracle_weights: Weights, quant: str, dims: str, seed: int
) -> None:
    engine = loaded_engine(quant, dims, seed)
    assert engine.config == oracle_weights.config
    hf = to_hf_model(oracle_weights)
    lengths = sequence_lengths(seed)
    assert len(lengths) >= 20 and max(lengths) == MAX_LEN
    worst = worst_relative_error(engine, hf, lengths, seed)
    assert max(worst) <= MAX_REL_ERR, (
        f"{quant}/{dims}: worst per-position relative error {max(worst):.3e}; "
        f"by sequence length: {dict(zip(lengths, (f'{w:.1e}' for w in worst), strict=True))}"
    )


def test_f32_logits_match_hf(loaded_engine, canonical_weights) -> None:
    check_against_hf(loaded_engine, canonical_weights("tiny", 0), "F32", "tiny", 0)


@pytest.fixture(scope="module")
def q8_0_oracle(canonical_weights) -> Weights:
    """tiny seed 1 through Q8_0 and gguf-py (248k embedding rows: built once for both users)."""
    return dequantized_canonical(canonical_weights("tiny", 1), "Q8_0")


@pytest.mark.slow
def test_q8_0_logits_match_hf_on_dequantized_weights(loaded_engine, q8_0_oracle, gguf_model) -> None:
    types = {r.ggml_type for r in open_gguf(gguf_model("Q8_0", "tiny", 1)).tensors.values()}
    assert types == {Q.Q8_0, Q.F32}
    check_against_hf(loaded_engine, q8_0_oracle, "Q8_0", "tiny", 1)


@pytest.mark.slow
def test_q4_k_m_logits_match_hf_on_dequantized_weights(loaded_engine, canonical_weights, gguf_model) -> None:
    # `small` dims: rows of 256/512 are whole K-quant blocks, so real Q4_K and Q6_K tensors are
    # in the file (tiny's 64-wide rows fall back to Q5_0/Q8_0).
    path: Path = gguf_model("Q4_K_M", "small", 2)
    types = {r.ggml_type for r in open_gguf(path).tensors.values()}
    assert {Q.Q4_K, Q.Q6_K} <= types
    oracle = dequantized_canonical(canonical_weights("small", 2), "Q4_K_M")
    check_against_hf(loaded_engine, oracle, "Q4_K_M", "small", 2)


def test_quantised_oracle_differs_from_float_weights(canonical_weights, q8_0_oracle) -> None:
    """Guard on the oracle itself: the Q8_0 weights really are the quantised ones, so the Q8_0
    comparison cannot pass by comparing two float models."""
    w = canonical_weights("tiny", 1)
    dq = q8_0_oracle
    assert not torch.equal(dq.layers[0]["attn_qkv"], w.layers[0]["attn_qkv"])
    assert torch.allclose(dq.layers[0]["attn_qkv"], w.layers[0]["attn_qkv"], atol=0.02)
    assert torch.equal(dq.layers[0]["ssm_a"], w.layers[0]["ssm_a"])  # F32 stays exact
