"""What `Engine.load` reads from disk besides the weights: the tokenizer, the digest records name,
the vision projector beside the model, and the options every tensor-parallel rank loads with.

May import: `engine.model`, `engine.decide.decision_config`, `engine.vision.mmproj`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from engine.decide.decision_config import DecisionConfig, load_decision_config
from engine.model.gguf import GGUFError, GGUFFile
from engine.model.tokenizer import Tokenizer, TokenizerError
from engine.quant.calibration import DEFAULT_ALPHA
from engine.run.path import Precision
from engine.vision.mmproj import VisionWeights, find_mmproj, load_mmproj

log = structlog.get_logger(__name__)

# StartLux serves states up to 32k tokens; a request past this is rejected, not run for minutes.
MAX_REQUEST_TOKENS = 40_000


@dataclass(frozen=True)
class LoadOptions:
    """Everything `Engine.load` takes besides the file and the device; tensor-parallel followers
    load with the same (pickled to them), so every rank makes the same choices."""

    precision: Precision | None = None  # None: int8 on CUDA, fp32 elsewhere
    decision_config: str | Path | DecisionConfig | None = None
    cache_bytes: int | None = None
    smooth_alpha: float = DEFAULT_ALPHA
    body: bool | None = None
    decoder: bool | None = None
    body_settings: Mapping[str, int | str] | None = None
    decoder_dots: str | None = None
    mmproj: str | Path | bool | None = None
    max_request_tokens: int = MAX_REQUEST_TOKENS

    def engine_arguments(self) -> dict[str, Any]:
        """The options `Engine(...)` takes as they are (precision, decision config and projector
        are resolved by the loader first)."""
        names = (
            "cache_bytes",
            "smooth_alpha",
            "body",
            "decoder",
            "body_settings",
            "decoder_dots",
            "max_request_tokens",
        )
        return {name: getattr(self, name) for name in names}


def file_digest(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_digest(path: Path, mmproj: Path | None = None) -> str:
    """The digest records name as their model: the GGUF file's sha256, or, when a vision projector
    is loaded beside it, a sha256 over both files' digests (decisions then depend on both)."""
    digest = file_digest(path)
    if mmproj is None:
        return digest
    return hashlib.sha256(f"{digest}+mmproj:{file_digest(mmproj)}".encode()).hexdigest()


def tokenizer_from_gguf(file: GGUFFile) -> Tokenizer:
    """The tokenizer the GGUF carries; a GGUFError naming the file when its metadata is unusable."""
    meta = file.metadata
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        if key not in meta:
            raise GGUFError(f"{file.path}: missing metadata key {key} (no tokenizer in this file)")
    try:
        return Tokenizer.from_gguf_metadata(
            meta["tokenizer.ggml.tokens"],
            meta.get("tokenizer.ggml.merges", []),
            meta["tokenizer.ggml.token_type"],
            meta.get("tokenizer.ggml.pre", "default"),
            model=meta.get("tokenizer.ggml.model", "gpt2"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        )
    except TokenizerError as e:
        raise GGUFError(f"{file.path}: unusable tokenizer metadata: {e}") from None


def decision_config_of(given: str | Path | DecisionConfig | None, model: Path) -> DecisionConfig:
    """The decision config given, or read from the path given, or the one beside the model."""
    if isinstance(given, DecisionConfig):
        return given
    return load_decision_config(given if given is not None else model)


def vision_for(
    model: Path, hidden_size: int, mmproj: str | Path | bool | None
) -> tuple[VisionWeights | None, Path | None]:
    """The vision projector and its path: `mmproj` None finds one beside the model by llama.cpp's
    naming (`mmproj-*.gguf`), True requires one there, False loads none. A projector found beside
    the model that projects to another hidden size is another model's: skipped with a warning (named
    by the caller: an error)."""
    path = find_mmproj(model) if mmproj is None or mmproj is True else mmproj or None
    if mmproj is True and path is None:
        raise FileNotFoundError(f"no mmproj-*.gguf next to {model}: pass its path")
    vision = load_mmproj(path) if path is not None else None
    if vision is not None and vision.config.out_hidden_size != hidden_size:
        why = (
            f"{path}: projects to {vision.config.out_hidden_size} dims, "
            f"the model {model.name} has {hidden_size}: not its projector"
        )
        if mmproj is not None:  # named by the caller: an error
            raise GGUFError(why)
        log.warning("mmproj_skipped", reason=why)  # found beside it: another model's projector
        return None, None
    return vision, Path(path) if vision is not None else None
