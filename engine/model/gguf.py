"""Read a GGUF file: metadata as Python values, tensors as raw byte views of one memory map.

The header is parsed here rather than with `gguf.GGUFReader` because the reader builds
numpy objects per array element: on the 248,320-token qwen35 vocabulary (tokens, types and
merges) it needs ~11 s per open, against well under a second here. Tests cross-check every
field and tensor record against `GGUFReader`, which stays the format oracle.

The map is copy-on-write (`mode="c"`): tensors handed out as zero-copy views may be written
to (SmoothQuant folds scales into norm weights in place) without touching the file or
segfaulting on a read-only page; pages are only copied when written.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.model.config import ModelConfig

log = structlog.get_logger(__name__)

ARCH = "qwen35"
GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)


class GGUFError(ValueError):
    """A GGUF file (or its metadata) cannot serve as a qwen35 model; the message says why."""


_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_NP_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class TensorRecord:
    """One tensor as stored: `data` is a uint8 view of the file map, shaped
    `[*shape[:-1], bytes_per_row]` (for F32 that is `4 * shape[-1]` bytes per row)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: GGUF `ne` reversed, e.g. [out, in]
    data: np.ndarray  # uint8
    offset: int  # absolute byte offset in the file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


class _Cursor:
    """Sequential little-endian reads over the mapped header; raises GGUFError past the end."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated GGUF header while reading {what} "
                f"(needs byte {self.pos + n}, file has {len(self.buf)})"
            )

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, size = _SCALARS[vtype]
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        if vtype == GGUFValueType.FLOAT32:
            # The shortest decimal that round-trips in float32: 1e-6, not 9.99999997e-07.
            return float(str(np.float32(value)))
        return value

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        self._need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e})") from None

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            itype = self.u32(what)
            count = self.u64(what)
            if itype in _NP_SCALARS:
                dt = np.dtype(_NP_SCALARS[itype])
                self._need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            if itype == GGUFValueType.STRING:
                return self._strings(count, what)
            return [self.value(itype, what) for _ in range(count)]
        raise GGUFError(f"{self.path}: {what} has unknown GGUF value type {vtype}")

    def _strings(self, count: int, what: str) -> list[str]:
        # The hot loop for 248k-entry vocabularies: plain slicing, no per-item numpy.
        buf, pos, end = self.buf, self.pos, len(self.buf)
        out: list[str] = []
        unpack = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > end:
                    raise struct.error("string past end")
                out.append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except struct.error:
            raise GGUFError(f"{self.path}: truncated GGUF header while reading {what}") from None
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e})") from None
        self.pos = pos
        return out


class GGUFFile:
    """An opened GGUF: `metadata` (key -> Python value) and `tensors` (name -> TensorRecord)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        if self.path.stat().st_size == 0:
            raise GGUFError(f"{self.path}: not a GGUF file (empty)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="c")
        cur = _Cursor(memoryview(self._map), self.path)
        if bytes(self._map[:4]) != GGUF_MAGIC:
            raise GGUFError(
                f"{self.path}: not a GGUF file (magic {bytes(self._map[:4])!r}, expected b'GGUF')"
            )
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (big-endian file?)" if self.version & 0xFFFF == 0 else ""
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version}{hint}")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.u32(f"type of {key}")
            self.metadata[key] = cur.value(vtype, f"metadata {key}")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.u32(f"rank of {name}")
            ne = [cur.u64(f"shape of {name}") for _ in range(n_dims)]
            raw_type = cur.u32(f"type of {name}")
            offset = cur.u64(f"offset of {name}")
            infos.append((name, ne, raw_type, offset))
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {self.alignment} is not a power of two")
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorRecord] = {}
        for name, ne, raw_type, offset in infos:
            self.tensors[name] = self._record(name, ne, raw_type, offset)
        log.debug("gguf_opened", path=str(self.path), tensors=len(self.tensors), keys=len(self.metadata))

    def _record(self, name: str, ne: list[int], raw_type: int, offset: int) -> TensorRecord:
        if name in self.tensors:
            raise GGUFError(f"{self.path}: duplicate tensor {name}")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{self.path}: tensor {name} has unknown ggml type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(int(d) for d in reversed(ne))
        if not shape or shape[-1] % block:
            raise GGUFError(f"{self.path}: tensor {name} {shape} rows are not whole {qtype.name} blocks")
        row_bytes = shape[-1] // block * type_size
        n_bytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        start = self.data_offset + offset
        if start + n_bytes > len(self._map):
            raise GGUFError(
                f"{self.path}: truncated file: tensor {name} needs bytes {start}..{start + n_bytes}, "
                f"file has {len(self._map)}"
            )
        data = self._map[start : start + n_bytes].view(np.ndarray).reshape(*shape[:-1], row_bytes)
        return TensorRecord(name=name, ggml_type=qtype, shape=shape, data=data, offset=start)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def tensor(self, name: str) -> TensorRecord:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name}") from None

    def config(self) -> ModelConfig:
        """Model config from the metadata; embeddings are tied when `output.weight` is absent."""
        try:
            return config_from_metadata(self.metadata, tied_embeddings="output.weight" not in self.tensors)
        except GGUFError as e:
            raise GGUFError(f"{self.path}: {e}") from None


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)


def _key(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    if key in meta:
        return meta[key]
    if default is None:
        raise GGUFError(f"missing metadata key {key}")
    return default


def _per_layer(value: Any, key: str, layers: list[int]) -> int:
    """Some converters write head counts per layer; qwen35 needs one value on attention layers."""
    if not isinstance(value, list):
        return int(value)
    picked = {int(value[i]) for i in layers if i < len(value)}
    if len(picked) != 1:
        raise GGUFError(f"metadata {key} must hold one value on the attention layers, got {sorted(picked)}")
    return picked.pop()


def config_from_metadata(meta: Mapping[str, Any], *, tied_embeddings: bool = False) -> ModelConfig:
    """ModelConfig of a qwen35 model from its GGUF metadata (any size, with or without MTP).

    `block_count` includes the MTP block when one is exported (`nextn_predict_layers`), so the
    decoder has `block_count - nextn_predict_layers` layers.
    """
    arch = meta.get("general.architecture")
    if arch is None:
        raise GGUFError("missing metadata key general.architecture")
    if arch != ARCH:
        raise GGUFError(f"wrong architecture {arch!r}: this engine serves {ARCH!r} (Qwen3.5 hybrid) only")
    p = f"{ARCH}."
    block_count = int(_key(meta, p + "block_count"))
    mtp = int(_key(meta, p + "nextn_predict_layers", 0))
    num_layers = block_count - mtp
    if num_layers <= 0:
        raise GGUFError(f"block_count {block_count} leaves no decoder layer after {mtp} MTP layer(s)")
    interval = int(_key(meta, p + "full_attention_interval", 4))
    attn_layers = [i for i in range(num_layers) if (i + 1) % interval == 0] or [0]
    head_dim = int(_key(meta, p + "attention.key_length"))
    value_length = int(_key(meta, p + "attention.value_length", head_dim))
    if value_length != head_dim:
        raise GGUFError(f"attention.key_length {head_dim} != attention.value_length {value_length}")
    num_v = int(_key(meta, p + "ssm.time_step_rank"))
    num_k = int(_key(meta, p + "ssm.group_count"))
    inner = int(_key(meta, p + "ssm.inner_size"))
    if num_v <= 0 or num_k <= 0 or num_v % num_k:
        raise GGUFError(f"ssm.time_step_rank {num_v} must be a positive multiple of ssm.group_count {num_k}")
    if inner % num_v:
        raise GGUFError(f"ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {num_v}")
    rope_dims = int(_key(meta, p + "rope.dimension_count"))
    if not 0 < rope_dims <= head_dim or rope_dims % 2:
        raise GGUFError(f"rope.dimension_count {rope_dims} must be even and within head_dim {head_dim}")
    vocab = meta.get(p + "vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise GGUFError(f"missing metadata key {p}vocab_size (and no tokenizer.ggml.tokens)")
        vocab = len(tokens)
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=int(_key(meta, p + "embedding_length")),
        num_layers=num_layers,
        intermediate_size=int(_key(meta, p + "feed_forward_length")),
        num_attention_heads=_per_layer(_key(meta, p + "attention.head_count"), "head_count", attn_layers),
        num_kv_heads=_per_layer(_key(meta, p + "attention.head_count_kv"), "head_count_kv", attn_layers),
        head_dim=head_dim,
        rope_dims=rope_dims,
        rope_theta=float(_key(meta, p + "rope.freq_base")),
        rms_norm_eps=float(_key(meta, p + "attention.layer_norm_rms_epsilon")),
        full_attention_interval=interval,
        linear_num_key_heads=num_k,
        linear_num_value_heads=num_v,
        linear_key_head_dim=int(_key(meta, p + "ssm.state_size")),
        linear_value_head_dim=inner // num_v,
        conv_kernel=int(_key(meta, p + "ssm.conv_kernel")),
        tied_embeddings=tied_embeddings,
        context_length=int(_key(meta, p + "context_length", 262144)),
        mtp_layers=mtp,
        rope_sections=tuple(int(s) for s in _key(meta, p + "rope.dimension_sections", [11, 11, 10, 0])),
    )
