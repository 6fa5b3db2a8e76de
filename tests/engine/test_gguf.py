"""engine.model.gguf: header parsing (cross-checked against gguf.GGUFReader), config, clear errors."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from engine.model.gguf import GGUFError, config_from_metadata, open_gguf
from engine.model.loader import load_weights
from engine.testing.make_model import canonical_random_weights, dims_config, write_gguf


@dataclasses.dataclass
class FakeVocab:
    """A tiny stand-in vocabulary for files that only exercise error paths."""

    tokens: list[str]

    def write_to(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(self.tokens)


SMALL_VOCAB = 512


def tiny_small_vocab_config():
    return dims_config("tiny", vocab_size=SMALL_VOCAB)


def write_small(path: Path, weights=None, quant: str = "F32") -> Path:
    weights = weights or canonical_random_weights(tiny_small_vocab_config(), seed=1)
    return write_gguf(path, weights, quant, vocab=FakeVocab([f"t{i}" for i in range(SMALL_VOCAB)]))


def assert_matches_gguf_reader(path: Path) -> None:
    ours = open_gguf(path)
    ref = gguf.GGUFReader(path)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(ref_meta)
    for key, value in ref_meta.items():
        if isinstance(value, float):  # we report the shortest float32 decimal
            assert np.float32(ours.metadata[key]) == np.float32(value), key
        else:
            assert ours.metadata[key] == value, key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        rec = ours.tensors[t.name]
        assert rec.ggml_type == t.tensor_type
        assert rec.shape == tuple(reversed(t.shape.tolist()))
        assert rec.offset == t.data_offset
        assert rec.data.dtype == np.uint8
        assert np.array_equal(rec.data.reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q4_K_M"])
def test_parser_matches_gguf_reader(tmp_path: Path, quant: str) -> None:
    assert_matches_gguf_reader(write_small(tmp_path / f"{quant}.gguf", quant=quant))


@pytest.mark.slow
def test_parser_matches_gguf_reader_on_full_vocabulary(gguf_model) -> None:
    """The real 248k-token vocabulary and merges (GGUFReader alone takes ~11 s on them)."""
    assert_matches_gguf_reader(gguf_model("Q4_K_M", "tiny"))


@pytest.mark.parametrize("dims", ["tiny", "small"])
def test_config_from_generated_file(gguf_model, dims: str) -> None:
    f = open_gguf(gguf_model("Q8_0", dims))
    assert f.architecture == "qwen35"
    assert f.config() == dims_config(dims)


def test_config_with_mtp_block(gguf_model) -> None:
    f = open_gguf(gguf_model("F32", "tiny", mtp=True))
    assert f.metadata["qwen35.block_count"] == 5
    assert f.metadata["qwen35.nextn_predict_layers"] == 1
    assert "blk.4.nextn.eh_proj.weight" in f.tensors
    assert f.config() == dataclasses.replace(dims_config("tiny"), mtp_layers=1)


def real_metadata(size: str, mtp: bool) -> dict[str, Any]:
    """Metadata as llama.cpp's converter writes it for the published sizes (engine-anchors §1)."""
    hidden, layers, ffn, heads, kv, v_heads = {
        "0.8B": (1024, 24, 3584, 8, 2, 16),
        "4B": (2560, 32, 9216, 16, 4, 32),
        "27B": (5120, 64, 17408, 24, 4, 48),
    }[size]
    p = "qwen35."
    meta: dict[str, Any] = {
        "general.architecture": "qwen35",
        p + "block_count": layers + (1 if mtp else 0),
        p + "context_length": 262144,
        p + "embedding_length": hidden,
        p + "feed_forward_length": ffn,
        p + "attention.head_count": heads,
        p + "attention.head_count_kv": kv,
        p + "attention.key_length": 256,
        p + "attention.value_length": 256,
        p + "attention.layer_norm_rms_epsilon": 1e-6,
        p + "rope.freq_base": 1e7,
        p + "rope.dimension_count": 64,
        p + "rope.dimension_sections": [11, 11, 10, 0],
        p + "full_attention_interval": 4,
        p + "ssm.conv_kernel": 4,
        p + "ssm.state_size": 128,
        p + "ssm.group_count": 16,
        p + "ssm.time_step_rank": v_heads,
        p + "ssm.inner_size": 128 * v_heads,
        "tokenizer.ggml.tokens": ["x"] * 248320,
    }
    if mtp:
        meta[p + "nextn_predict_layers"] = 1
    return meta


@pytest.mark.parametrize("mtp", [False, True])
@pytest.mark.parametrize(
    ("size", "layers", "hidden", "heads", "v_heads", "tied"),
    [("0.8B", 24, 1024, 8, 16, True), ("4B", 32, 2560, 16, 32, True), ("27B", 64, 5120, 24, 48, False)],
)
def test_config_for_published_sizes(size, layers, hidden, heads, v_heads, tied, mtp) -> None:
    c = config_from_metadata(real_metadata(size, mtp), tied_embeddings=tied)
    assert (c.num_layers, c.hidden_size, c.num_attention_heads) == (layers, hidden, heads)
    assert c.mtp_layers == (1 if mtp else 0)
    assert c.vocab_size == 248320  # no qwen35.vocab_size: counted from the token list
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (16, v_heads)
    assert (c.linear_key_head_dim, c.linear_value_head_dim, c.head_dim, c.rope_dims) == (128, 128, 256, 64)
    assert c.conv_dim == 2 * 16 * 128 + v_heads * 128
    assert c.full_attention_layers == list(range(3, layers, 4))
    assert c.tied_embeddings is tied
    assert c.rms_norm_eps == 1e-6 and c.rope_theta == 1e7


def test_wrong_architecture() -> None:
    meta = real_metadata("4B", False) | {"general.architecture": "llama"}
    with pytest.raises(GGUFError, match=r"wrong architecture 'llama'"):
        config_from_metadata(meta)


def test_missing_metadata_key() -> None:
    meta = real_metadata("4B", False)
    del meta["qwen35.ssm.group_count"]
    with pytest.raises(GGUFError, match=r"missing metadata key qwen35\.ssm\.group_count"):
        config_from_metadata(meta)


def test_wrong_architecture_file(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"llama\.gguf: wrong architecture 'llama'"):
        load_weights(tmp_path / "llama.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "notes.txt"
    p.write_text("hello, this is not a model")
    with pytest.raises(GGUFError, match=r"notes\.txt: not a GGUF file"):
        open_gguf(p)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match=r"empty\.gguf: not a GGUF file \(empty\)"):
        open_gguf(empty)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        open_gguf(tmp_path / "absent.gguf")


def test_truncated_files(tmp_path: Path) -> None:
    src = write_small(tmp_path / "full.gguf").read_bytes()
    header = tmp_path / "header.gguf"
    header.write_bytes(src[:2000])  # cut inside the metadata
    with pytest.raises(GGUFError, match=r"header\.gguf: truncated GGUF header while reading"):
        open_gguf(header)
    data = tmp_path / "data.gguf"
    data.write_bytes(src[: len(src) - 100])  # cut inside the last tensor
    with pytest.raises(GGUFError, match=r"data\.gguf: truncated file: tensor output\.weight needs bytes"):
        open_gguf(data)


def test_missing_tensor(tmp_path: Path) -> None:
    w = canonical_random_weights(tiny_small_vocab_config(), seed=1)
    del w.layers[2]["ssm_beta"]
    path = write_small(tmp_path / "missing.gguf", w)
    with pytest.raises(GGUFError, match=r"missing\.gguf: missing tensor blk\.2\.ssm_beta\.weight"):
        load_weights(path)


def test_misshaped_tensor(tmp_path: Path) -> None:
    w = canonical_random_weights(tiny_small_vocab_config(), seed=1)
    w.layers[1]["ffn_up"] = w.layers[1]["ffn_up"][:96]
    path = write_small(tmp_path / "shape.gguf", w)
    with pytest.raises(
        GGUFError, match=r"tensor blk\.1\.ffn_up\.weight has shape \[96, 64\], expected \[128, 64\]"
    ):
        load_weights(path)


def patch_tensor_type(path: Path, name: str, new_type: int) -> None:
    """Rewrite one tensor's type id in the header (the tensor-info record after its name)."""
    buf = bytearray(path.read_bytes())
    encoded = name.encode()
    at = buf.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    (n_dims,) = struct.unpack_from("<I", buf, at)
    struct.pack_into("<I", buf, at + 4 + 8 * n_dims, new_type)
    path.write_bytes(bytes(buf))


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    path = write_small(tmp_path / "itype.gguf")
    # I32 has F32's byte size, so the file stays consistent; only the type is unusable.
    patch_tensor_type(path, "blk.0.ssm_a", int(gguf.GGMLQuantizationType.I32))
    assert open_gguf(path).tensors["blk.0.ssm_a"].ggml_type == gguf.GGMLQuantizationType.I32
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.ssm_a has unsupported type I32"):
        load_weights(path)


def test_bad_tensor_type_id(tmp_path: Path) -> None:
    path = write_small(tmp_path / "badtype.gguf")
    patch_tensor_type(path, "blk.0.ssm_a", 999)
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.ssm_a has unknown ggml type 999"):
        open_gguf(path)
