"""Generator -> GGUF -> loader round trips, the V-head tiling convention and the quant mixes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.model.gguf import open_gguf
from engine.model.loader import (
    is_zero_copy,
    load_raw_tensor,
    load_tensor,
    load_weights,
    tensor_name,
    v_reorder,
)
from engine.model.weights import Weights
from engine.testing.make_model import (
    dims_config,
    main,
    quantize,
    tile_v_heads,
)

V_KEYS = ("attn_qkv", "ssm_conv1d", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt", "ssm_out")


def untile(config, key: str, stored: torch.Tensor) -> torch.Tensor:
    """Invert the generator's tiling by tracking where each canonical index went (oracle that
    does not use the loader's permutation)."""
    axis = 1 if key == "ssm_out" else 0
    n = stored.shape[axis]
    tags = torch.arange(n, dtype=torch.float64)
    if key == "ssm_out":
        where = tile_v_heads(config, key, tags[None, :].expand(2, n))[0]
    elif stored.dim() == 2:
        where = tile_v_heads(config, key, tags[:, None].expand(n, 2))[:, 0]
    else:
        where = tile_v_heads(config, key, tags)
    inverse = torch.empty(n, dtype=torch.long)
    inverse[where.long()] = torch.arange(n)
    return stored.index_select(axis, inverse)


def expected_loaded(weights: Weights, path: Path) -> Weights:
    """What loading must give: each tensor in GGUF layout, through the file's type via gguf-py's
    quantise/dequantise, back to canonical order."""
    f = open_gguf(path)
    c = weights.config

    def through(name: str, key: str, t: torch.Tensor, layered: bool) -> torch.Tensor:
        qtype = f.tensors[name].ggml_type
        stored = tile_v_heads(c, key, t) if layered else t
        data = quantize(stored.numpy(), qtype)
        back = torch.from_numpy(np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32))
        return untile(c, key, back) if layered and key in V_KEYS else back

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


def assert_weights_equal(got: Weights, want: Weights) -> None:
    assert got.config == want.config
    assert torch.equal(got.token_embd, want.token_embd)
    assert torch.equal(got.output_norm, want.output_norm)
    assert torch.equal(got.output, want.output)
    assert len(got.layers) == len(want.layers)
    for i, (g, w) in enumerate(zip(got.layers, want.layers, strict=True)):
        assert set(g) == set(w) == set(got.layer_keys(i))
        for key in w:
            assert g[key].dtype == torch.float32
            assert torch.equal(g[key], w[key]), (i, key)


def test_f32_round_trip_is_exact(gguf_model, canonical_weights) -> None:
    want = canonical_weights("tiny")
    path = gguf_model("F32", "tiny")
    got = load_weights(path)
    assert_weights_equal(got, want)
    assert got.output is not got.token_embd  # tiny is untied


def test_f32_tensors_without_reorder_are_zero_copy(gguf_model) -> None:
    f = open_gguf(gguf_model("F32", "tiny"))
    w = load_weights(f)
    assert is_zero_copy(w.token_embd, f.tensors["token_embd.weight"])
    assert is_zero_copy(w.layers[0]["ffn_up"], f.tensors["blk.0.ffn_up.weight"])
    assert is_zero_copy(w.layers[0]["ssm_norm"], f.tensors["blk.0.ssm_norm.weight"])
    assert not is_zero_copy(w.layers[0]["ssm_a"], f.tensors["blk.0.ssm_a"])  # un-tiled: a copy
    # Copy-on-write map: writing a view changes neither the file nor a fresh open.
    w.layers[0]["ffn_up"].mul_(2)
    again = load_tensor(gguf_model("F32", "tiny"), "ffn_up", 0)
    assert torch.equal(again * 2, w.layers[0]["ffn_up"])


def test_mtp_block_is_skipped(gguf_model, canonical_weights) -> None:
    got = load_weights(gguf_model("F32", "tiny", mtp=True))
    want = canonical_weights("tiny")
    assert got.config.mtp_layers == 1 and got.config.num_layers == 4
    assert_weights_equal(got, dataclasses.replace(want, config=got.config))


@pytest.mark.parametrize(("quant", "dims"), [("Q8_0", "tiny"), ("Q4_K_M", "tiny"), ("Q4_K_M", "small")])
def test_quantised_round_trip_equals_gguf_py(gguf_model, canonical_weights, quant: str, dims: str) -> None:
    path = gguf_model(quant, dims)
    got = load_weights(path)
    assert_weights_equal(got, expected_loaded(canonical_weights(dims), path))
    if dims == "small":
        assert got.output is got.token_embd  # tied


def test_loaded_bf16_matches_float32_cast(gguf_model) -> None:
    path = gguf_model("Q8_0", "tiny")
    f32, bf16 = load_weights(path), load_weights(path, dtype=torch.bfloat16)
    assert bf16.layers[0]["attn_qkv"].dtype == torch.bfloat16
    assert torch.equal(bf16.layers[0]["attn_qkv"], f32.layers[0]["attn_qkv"].to(torch.bfloat16))
    assert torch.equal(bf16.layers[3]["attn_q_norm"], f32.layers[3]["attn_q_norm"].to(torch.bfloat16))


def test_tiling_convention_matches_llama_cpp() -> None:
    """In GGUF order value head j reads key head j % num_k (engine-anchors, Confirmed section);
    in canonical order head j reads key head j // (num_v / num_k)."""
    c = dims_config("tiny", linear_num_key_heads=2, linear_num_value_heads=6)
    ratio = c.linear_num_value_heads // c.linear_num_key_heads
    key_head_of = torch.tensor([j // ratio for j in range(c.linear_num_value_heads)], dtype=torch.float32)
    tiled = tile_v_heads(c, "ssm_a", key_head_of)
    assert tiled.tolist() == [j % c.linear_num_key_heads for j in range(c.linear_num_value_heads)]


@pytest.mark.parametrize("heads", [(2, 4), (2, 6), (3, 12), (4, 4)])
@pytest.mark.parametrize("key", V_KEYS)
def test_loader_reorder_inverts_generator_tiling(key: str, heads: tuple[int, int]) -> None:
    c = dims_config("tiny", linear_num_key_heads=heads[0], linear_num_value_heads=heads[1])
    shape = {
        "attn_qkv": (c.conv_dim, 8),
        "ssm_conv1d": (c.conv_dim, 4),
        "attn_gate": (c.linear_value_dim, 8),
        "ssm_alpha": (c.linear_num_value_heads, 8),
        "ssm_beta": (c.linear_num_value_heads, 8),
        "ssm_a": (c.linear_num_value_heads,),
        "ssm_dt": (c.linear_num_value_heads,),
        "ssm_out": (8, c.linear_value_dim),
    }[key]
    t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    stored = tile_v_heads(c, key, t)
    r = v_reorder(c, key)
    if heads[0] == heads[1]:
        assert r is None and torch.equal(stored, t)
        return
    assert r is not None and r.axis == (1 if key == "ssm_out" else 0)
    assert torch.equal(stored.index_select(r.axis, r.index), t)
    assert not torch.equal(stored, t)


def test_raw_tensor_access(gguf_model) -> None:
    path = gguf_model("Q8_0", "tiny")
    rec = load_raw_tensor(path, "blk.0.attn_qkv.weight")
    c = open_gguf(path).config()
    assert rec.ggml_type == Q.Q8_0 and rec.shape == (c.conv_dim, c.hidden_size)
    assert rec.data.shape == (c.conv_dim, c.hidden_size // 32 * 34)
    # Q8_0 rows permuted as raw bytes then dequantised == the loader's canonical tensor.
    r = v_reorder(c, "attn_qkv")
    rows = torch.from_numpy(rec.data.copy()).index_select(0, r.index)
    from engine.model.dequant import dequantize

    assert torch.equal(dequantize(rows, rec.ggml_type, rec.shape), load_tensor(path, "attn_qkv", 0))


def tiny_q4_k_m_expected() -> dict[str, Q]:
    """llama.cpp's Q4_K_M mix worked by hand for tiny (4 layers, rows of 64/128): use_more_bits
    picks layers 2 and 3; every K-type falls back (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    want = {"token_embd.weight": Q.Q5_0, "output.weight": Q.Q8_0, "output_norm.weight": Q.F32}
    for i in range(4):
        more = i in (2, 3)
        want |= {
            f"blk.{i}.attn_norm.weight": Q.F32,
            f"blk.{i}.post_attention_norm.weight": Q.F32,
            f"blk.{i}.ffn_gate.weight": Q.Q5_0,
            f"blk.{i}.ffn_up.weight": Q.Q5_0,
            f"blk.{i}.ffn_down.weight": Q.Q8_0 if more else Q.Q5_0,
        }
        if i == 3:
            want |= {
                "blk.3.attn_q.weight": Q.Q5_0,
                "blk.3.attn_k.weight": Q.Q5_0,
                "blk.3.attn_v.weight": Q.Q8_0,
                "blk.3.attn_output.weight": Q.Q5_0,
                "blk.3.attn_q_norm.weight": Q.F32,
                "blk.3.attn_k_norm.weight": Q.F32,
            }
        else:
            want |= {
                f"blk.{i}.attn_qkv.weight": Q.Q8_0 if more else Q.Q5_0,
                f"blk.{i}.attn_gate.weight": Q.Q5_0,
                f"blk.{i}.ssm_beta.weight": Q.Q5_0,
                f"blk.{i}.ssm_alpha.weight": Q.Q5_0,
                f"blk.{i}.ssm_out.weight": Q.Q5_0,
                f"blk.{i}.ssm_conv1d.weight": Q.F32,
                f"blk.{i}.ssm_dt.bias": Q.F32,
                f"blk.{i}.ssm_a": Q.F32,
                f"blk.{i}.ssm_norm.weight": Q.F32,
            }
    return want


def small_q4_k_m_expected() -> dict[str, Q]:
    """small (8 layers, hidden 256, tied): use_more_bits picks layers 0, 3, 6, 7; rows of 256/512
    are whole K blocks, ssm_out rows (value_dim 128) fall back to Q5_0; the tied embedding is Q6_K."""
    want = {"token_embd.weight": Q.Q6_K, "output_norm.weight": Q.F32}
    for i in range(8):
        more = Q.Q6_K if i in (0, 3, 6, 7) else Q.Q4_K
        want |= {
            f"blk.{i}.attn_norm.weight": Q.F32,
            f"blk.{i}.post_attention_norm.weight": Q.F32,
            f"blk.{i}.ffn_gate.weight": Q.Q4_K,
            f"blk.{i}.ffn_up.weight": Q.Q4_K,
            f"blk.{i}.ffn_down.weight": more,
        }
        if i in (3, 7):
            want |= {f"blk.{i}.attn_{k}.weight": Q.Q4_K for k in ("q", "k", "output")}
            want |= {f"blk.{i}.attn_v.weight": more}
            want |= {f"blk.{i}.attn_{k}_norm.weight": Q.F32 for k in ("q", "k")}
        else:
            want |= {f"blk.{i}.{k}.weight": Q.Q4_K for k in ("attn_gate", "ssm_beta", "ssm_alpha")}
            want |= {f"blk.{i}.attn_qkv.weight": more, f"blk.{i}.ssm_out.weight": Q.Q5_0}
            want |= {
                f"blk.{i}.{k}": Q.F32
                for k in ("ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight")
            }
    return want


def test_q4_k_m_mix_tiny(gguf_model) -> None:
    f = open_gguf(gguf_model("Q4_K_M", "tiny"))
    assert {n: r.ggml_type for n, r in f.tensors.items()} == tiny_q4_k_m_expected()
    assert f.metadata["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)


def test_q4_k_m_mix_small(gguf_model) -> None:
    f = open_gguf(gguf_model("Q4_K_M", "small"))
    assert {n: r.ggml_type for n, r in f.tensors.items()} == small_q4_k_m_expected()


def test_q8_0_mix(gguf_model) -> None:
    f = open_gguf(gguf_model("Q8_0", "tiny"))
    for name, rec in f.tensors.items():
        f32_only = len(rec.shape) == 1 or "norm" in name or "ssm_conv1d" in name
        assert rec.ggml_type == (Q.F32 if f32_only else Q.Q8_0), name


def test_tokenizer_metadata_is_the_real_vocabulary(gguf_model) -> None:
    from engine.testing.vocab import qwen35_vocab

    meta = open_gguf(gguf_model("F32", "tiny")).metadata
    vocab = qwen35_vocab()
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == vocab.pre
    assert meta["tokenizer.ggml.tokens"] == vocab.tokens and len(vocab.tokens) == 248320
    assert meta["tokenizer.ggml.token_type"] == vocab.token_types
    assert meta["tokenizer.ggml.merges"] == vocab.merges
    assert meta["tokenizer.ggml.eos_token_id"] == vocab.eos_id
    assert meta["tokenizer.ggml.padding_token_id"] == vocab.pad_id
    assert meta["tokenizer.chat_template"] == vocab.chat_template


def test_random_weights_are_well_conditioned(canonical_weights) -> None:
    w = canonical_weights("tiny")
    for i, layer in enumerate(w.layers):
        for key in ("attn_norm", "post_attention_norm"):
            assert (layer[key] - 1).abs().max() < 0.6
        if not w.config.is_full_attention(i):
            assert ((layer["ssm_a"] <= -1) & (layer["ssm_a"] >= -16)).all()
            dt = torch.nn.functional.softplus(layer["ssm_dt"])
            assert ((dt > 0.9e-3) & (dt < 0.11)).all()
    std = w.layers[0]["ffn_up"].std().item()
    assert abs(std * w.config.hidden_size**0.5 - 1) < 0.05


def test_outliers_scale_a_few_channels(canonical_weights) -> None:
    base, spiky = canonical_weights("tiny"), canonical_weights("tiny", outliers=3)
    ratio = spiky.layers[0]["attn_norm"] / base.layers[0]["attn_norm"]
    channels = torch.nonzero(ratio != 1).flatten()
    assert len(channels) == 3
    assert ((ratio[channels] >= 20) & (ratio[channels] <= 50)).all()
    col_ratio = spiky.token_embd[:5, channels] / base.token_embd[:5, channels]
    assert torch.allclose(col_ratio, ratio[channels].expand(5, 3))
    assert torch.equal(spiky.layers[1]["ffn_down"], base.layers[1]["ffn_down"])


def test_cli_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    main(["--out", str(out), "--quant", "Q8_0", "--dims", "tiny", "--seed", "7", "--mtp", "--outliers", "2"])
    w = load_weights(out)
    assert w.config == dataclasses.replace(dims_config("tiny"), mtp_layers=1)
    assert "blk.4.nextn.eh_proj.weight" in open_gguf(out).tensors
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--quant", "Q2_K"])
