"""StartLux `jev_render_v3`: one Qwen3.5 ChatML prompt per question (DESIGN §1).

    <|im_start|>system\\n{SYSTEM_PROMPT}<|im_end|>\\n
    <|im_start|>user\\nEvidence:\\n{state}\\n\\nQuestion: {instructions}\\nOptions:\\nA) ...\\nB) ...
    <|im_end|>\\n                                 (the two lines above are one line of the prompt)
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n            <- the answer letter is the next token

This equals Qwen3.5's chat template with messages [system, user], add_generation_prompt=True and
enable_thinking=False (the template trims each message, so the user text is right-stripped here).
With `think=True` the assistant turn opens `<think>\\n` instead (AutoThink writes a thought there and
the letters are read again after `</think>\\n\\n`, see `PromptEncoder.think_close_ids`).

Prism's reading of the parts the protocol leaves open (the model was trained on StartLux's own
renderer, which is not public; these choices are recorded by `RENDER_VERSION`):
- state: a string is used verbatim; None, "" , a whitespace-only string, {} and [] render `(none)`;
  any other JSON value is compact JSON (`separators=(",", ":")`, `ensure_ascii=False`, keys in the
  given order, NaN/Infinity rejected).
- `_index`: every array with 8 or more elements, at any depth, has its elements numbered from 0.
  An object element gets `"_index": i` as its first key (an existing `_index` key is replaced); any
  other element becomes `{"_index": i, "value": element}`. Shorter arrays are left alone.
- instructions: a string is used verbatim; a JSON value is rendered like the state (compact,
  `_index`); None or "" asks `Which answer fits the evidence?` (for every question type).
- option text after `X) `: a missing (None, "" or whitespace-only) description shows the id alone; a
  description equal to the id after case-folding and removing whitespace, `_` and `-` shows the id
  alone; otherwise `id: description`. A choice id that is a bare letter (`^[A-Za-z]$`) or a bare
  number (`^[0-9]+$`) is replaced by its description when every option of the question (all of
  them, not just one round's) has a description. noul shows ids `yes`/`no` (descriptions from
  criteria "true"/"false"), score shows ids `0..n-1` with the level texts as descriptions.
- choices with more than 26 options are rendered per round: `option_ids` selects the round's
  options, lettered A.. in the order given.

Token layout (the packed forest splits here; both cuts fall where the qwen35 pre-tokenizer always
splits and NFC cannot merge, so prefix + evidence + question == tokenizing the whole prompt):
- prefix (root, the same for every request): `<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n`
- evidence: `Evidence:\\n{state}\\n\\n` (begins with a letter after a newline; ends with the newline
  run before `Question`, which no regex branch can extend past)
- question: `Question: ...<|im_end|>\\n<|im_start|>assistant\\n` + the think opener.
Template markers are encoded as trusted text; system, state, instructions and options as untrusted
text, so an `<|im_start|>` inside evidence is never a control token.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.model.tokenizer import Tokenizer

RENDER_VERSION = "jev_render_v3"
SYSTEM_PROMPT = (
    "Apply the criterion to the evidence. Choose exactly one listed option. Answer with its letter only."
)
DEFAULT_INSTRUCTIONS = "Which answer fits the evidence?"
EMPTY_STATE = "(none)"
INDEX_MIN_ELEMENTS = 8
MAX_LETTERS = 26
ROUND_SIZE = 25
QUESTION_TYPES = ("noul", "choice", "score")
NOUL_IDS = ("yes", "no")
_BARE_ID = re.compile(r"[A-Za-z]|[0-9]+")


class PromptError(ValueError):
    """A request cannot be rendered (names the offending field)."""


def letters(n: int) -> list[str]:
    """The first `n` option letters, A.. (at most 26: one letter token per option)."""
    if not 1 <= n <= MAX_LETTERS:
        raise PromptError(f"a prompt lists 1..{MAX_LETTERS} options, got {n}")
    return [chr(ord("A") + i) for i in range(n)]


def split_rounds(option_ids: Sequence[str], size: int = ROUND_SIZE) -> list[list[str]]:
    """Consecutive groups of at most `size` options, in the given order (first round of a >26 choice)."""
    if size < 1:
        raise PromptError(f"round size must be positive, got {size}")
    ids = list(option_ids)
    return [ids[i : i + size] for i in range(0, len(ids), size)]


# ------------------------------------------------------------------------------------------ JSON
def _indexed(value: Any, path: str) -> Any:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise PromptError(f"{path}: object key {k!r} is not a string")
            out[k] = _indexed(v, f"{path}.{k}")
        return out
    if isinstance(value, list | tuple):
        items = [_indexed(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if len(items) < INDEX_MIN_ELEMENTS:
            return items
        numbered: list[Any] = []
        for i, item in enumerate(items):
            if isinstance(item, dict):
                numbered.append({"_index": i, **{k: v for k, v in item.items() if k != "_index"}})
            else:
                numbered.append({"_index": i, "value": item})
        return numbered
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise PromptError(f"{path}: {value} is not a JSON number")
        return value
    raise PromptError(f"{path}: {type(value).__name__} is not a JSON value")


def render_json(value: Any, path: str = "value") -> str:
    """Compact JSON with `_index` on arrays of 8+ elements (see the module docstring)."""
    return json.dumps(_indexed(value, path), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def render_state(state: Any) -> str:
    """The evidence text placed after `Evidence:\\n`."""
    if state is None:
        return EMPTY_STATE
    if isinstance(state, str):
        return state if state.strip() else EMPTY_STATE
    if isinstance(state, Mapping | list | tuple) and len(state) == 0:
        return EMPTY_STATE
    return render_json(state, "state")


def render_instructions(instructions: Any) -> str:
    if instructions is None or (isinstance(instructions, str) and not instructions.strip()):
        return DEFAULT_INSTRUCTIONS
    if isinstance(instructions, str):
        return instructions
    return render_json(instructions, "instructions")


# --------------------------------------------------------------------------------------- options
def _field(question: Any, name: str) -> Any:
    if isinstance(question, Mapping):
        return question.get(name)
    return getattr(question, name, None)


def _plain(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    return dump(by_alias=True) if callable(dump) else value


def _has_text(desc: Any) -> bool:
    return isinstance(desc, str) and bool(desc.strip())


def _squash(s: str) -> str:
    return "".join(ch for ch in s.casefold() if not ch.isspace() and ch not in "_-")


def option_text(option_id: str, description: str | None, *, hide_id: bool = False) -> str:
    """The text after `X) ` for one option (rules in the module docstring)."""
    if description is not None and not isinstance(description, str):
        raise PromptError(f"option {option_id!r}: description must be a string or null")
    if not _has_text(description):
        return option_id
    assert description is not None
    if hide_id:
        return description
    if _squash(description) == _squash(option_id):
        return option_id
    return f"{option_id}: {description}"


def question_options(question: Any, option_ids: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(option id, shown text) per listed option, in letter order."""
    qtype = _field(question, "type")
    criteria = _plain(_field(question, "criteria"))
    if qtype not in QUESTION_TYPES:
        raise PromptError(f"question type must be one of {QUESTION_TYPES}, got {qtype!r}")
    if option_ids is not None and qtype != "choice":
        raise PromptError("option_ids (rounds) apply to choice questions only")

    if qtype == "noul":
        if criteria is None:
            criteria = {}
        if not isinstance(criteria, Mapping) or set(criteria) - {"true", "false"}:
            raise PromptError('noul criteria must be null or {"true": desc, "false": desc}')
        return [
            ("yes", option_text("yes", criteria.get("true"))),
            ("no", option_text("no", criteria.get("false"))),
        ]

    if qtype == "score":
        if isinstance(criteria, str) or not isinstance(criteria, Sequence) or len(criteria) < 2:
            raise PromptError("score criteria must be a list of at least 2 levels, lowest first")
        if len(criteria) > MAX_LETTERS:
            raise PromptError(f"score has {len(criteria)} levels; at most {MAX_LETTERS} fit one prompt")
        return [(str(i), option_text(str(i), desc)) for i, desc in enumerate(criteria)]

    if not isinstance(criteria, Mapping) or not criteria:
        raise PromptError("choice criteria must be a non-empty {option: description|null} object")
    for k in criteria:
        if not isinstance(k, str) or not k:
            raise PromptError(f"choice option id {k!r} must be a non-empty string")
    hide = all(_has_text(d) for d in criteria.values())
    ids = list(criteria) if option_ids is None else list(option_ids)
    if len(set(ids)) != len(ids):
        raise PromptError("option_ids repeats an option")
    unknown = [i for i in ids if i not in criteria]
    if unknown:
        raise PromptError(f"option_ids names options the question does not have: {unknown[:5]}")
    if len(ids) > MAX_LETTERS:
        raise PromptError(
            f"choice lists {len(ids)} options; more than {MAX_LETTERS} must be rendered in rounds "
            "(pass option_ids per round, see split_rounds)"
        )
    if not ids:
        raise PromptError("a round needs at least one option")
    return [(i, option_text(i, criteria[i], hide_id=hide and _BARE_ID.fullmatch(i) is not None)) for i in ids]


# ----------------------------------------------------------------------------------------- parts
@dataclass(frozen=True)
class PromptParts:
    """The text of one question prompt, cut where the forest cuts it."""

    system: str
    state_text: str  # rendered state (what follows "Evidence:\n")
    question_text: str  # "Question: ...\nOptions:\n..." right-stripped, as the template trims
    option_ids: tuple[str, ...]  # criteria key per letter: choice names, score "0".., noul "yes"/"no"
    labels: tuple[str, ...]  # text after "X) " per letter
    letters: tuple[str, ...]

    @property
    def evidence_text(self) -> str:
        return f"Evidence:\n{self.state_text}\n\n"

    @property
    def user(self) -> str:
        """The user message exactly as it appears between `user\\n` and `<|im_end|>`."""
        return self.evidence_text + self.question_text


def render_question_text(
    question: Any, option_ids: Sequence[str] | None = None
) -> tuple[str, list[tuple[str, str]]]:
    options = question_options(question, option_ids)
    lines = [f"{letter}) {text}" for letter, (_, text) in zip(letters(len(options)), options, strict=True)]
    text = f"Question: {render_instructions(_field(question, 'instructions'))}\nOptions:\n" + "\n".join(lines)
    return text.rstrip(), options


def render_parts(state: Any, question: Any, option_ids: Sequence[str] | None = None) -> PromptParts:
    """Render one question about `state` (a raw state value, rendered here)."""
    return render_parts_for_state_text(render_state(state), question, option_ids)


def render_parts_for_state_text(
    state_text: str, question: Any, option_ids: Sequence[str] | None = None
) -> PromptParts:
    """As `render_parts`, for a state already rendered once per request with `render_state`."""
    text, options = render_question_text(question, option_ids)
    return PromptParts(
        system=SYSTEM_PROMPT,
        state_text=state_text,
        question_text=text,
        option_ids=tuple(i for i, _ in options),
        labels=tuple(t for _, t in options),
        letters=tuple(letters(len(options))),
    )


# ---------------------------------------------------------------------------------------- tokens
@dataclass(frozen=True)
class PromptSegments:
    prefix: list[int]  # root: system turn + "<|im_start|>user\n"
    evidence: list[int]  # "Evidence:\n{state}\n\n"
    question: list[int]  # "Question: ...<|im_end|>\n<|im_start|>assistant\n" + think opener

    @property
    def token_ids(self) -> list[int]:
        return self.prefix + self.evidence + self.question


@dataclass(frozen=True)
class RenderedPrompt:
    parts: PromptParts
    segments: PromptSegments
    think: bool  # assistant turn opened with "<think>\n" (thought to be generated) instead of empty think
    render_version: str = RENDER_VERSION

    @property
    def system(self) -> str:
        return self.parts.system

    @property
    def user(self) -> str:
        return self.parts.user

    @property
    def token_ids(self) -> list[int]:
        return self.segments.token_ids

    @property
    def option_ids(self) -> tuple[str, ...]:
        return self.parts.option_ids

    @property
    def letters(self) -> tuple[str, ...]:
        return self.parts.letters


class PromptEncoder:
    """Turns rendered prompt parts into token ids; constant template pieces are encoded once."""

    def __init__(self, tokenizer: Tokenizer, system: str = SYSTEM_PROMPT) -> None:
        self.tokenizer = tokenizer
        sp = tokenizer.special
        enc = tokenizer.encode
        newline = enc("\n")
        self.system = system
        # The template trims the system message; SYSTEM_PROMPT has nothing to trim.
        self.prefix_ids: list[int] = (
            [sp.im_start]
            + enc("system\n" + system.strip())
            + [sp.im_end]
            + newline
            + [sp.im_start]
            + enc("user\n")
        )
        self._turn_end: list[int] = [sp.im_end] + newline + [sp.im_start] + enc("assistant\n")
        self._open_empty_think: list[int] = [sp.think] + enc("\n\n") + [sp.end_think] + enc("\n\n")
        self._open_think: list[int] = [sp.think] + newline
        self.think_close_ids: list[int] = [sp.end_think] + enc("\n\n")
        self.letter_ids: list[int] = [tokenizer.token_id(c) for c in letters(MAX_LETTERS)]

    def evidence_ids(self, state_text: str) -> list[int]:
        return self.tokenizer.encode(f"Evidence:\n{state_text}\n\n")

    def evidence_ids_batch(self, state_texts: Sequence[str]) -> list[list[int]]:
        return self.tokenizer.encode_batch([f"Evidence:\n{s}\n\n" for s in state_texts])

    def question_tail_ids(self, think: bool) -> list[int]:
        """Tokens after the question text: end of the user turn and the assistant opener."""
        return self._turn_end + (self._open_think if think else self._open_empty_think)

    def question_ids(self, question_text: str, *, think: bool = False) -> list[int]:
        return self.tokenizer.encode(question_text) + self.question_tail_ids(think)

    def question_ids_batch(self, question_texts: Sequence[str], *, think: bool = False) -> list[list[int]]:
        tail = self.question_tail_ids(think)
        return [ids + tail for ids in self.tokenizer.encode_batch(list(question_texts))]

    def encode(self, parts: PromptParts, *, think: bool = False) -> PromptSegments:
        if parts.system != self.system:
            raise PromptError("parts were rendered with a different system prompt than this encoder's")
        return PromptSegments(
            prefix=list(self.prefix_ids),
            evidence=self.evidence_ids(parts.state_text),
            question=self.question_ids(parts.question_text, think=think),
        )

    def render(
        self,
        state: Any,
        question: Any,
        *,
        option_ids: Sequence[str] | None = None,
        think: bool = False,
    ) -> RenderedPrompt:
        parts = render_parts(state, question, option_ids)
        return RenderedPrompt(parts=parts, segments=self.encode(parts, think=think), think=think)

    def letter_token_ids(self, n: int) -> list[int]:
        """Token ids of the first `n` letters (read-out rows of the LM head)."""
        return self.letter_ids[: len(letters(n))]
