"""Decision-affecting settings that live beside the weights, not in the GGUF.

StartLux ships its per-type read-out temperatures in a `decision_config.json` next to the
model file. Prism reads the same file and adds the AutoThink settings StartLux does not
publish (the mixing weight, the thought's sampling). Every field here changes the numbers a
decision record carries, so the whole object is hashed into the record (`digest()`): a replay
under a different config is detected, not silently compared.

File format (every key optional; a missing key takes the default, an unknown key is an error):

    {
      "temperatures": {"noul": 1.0, "choice": 1.0, "score": 1.0},
      "gate": 0.6,
      "thought_budget": 4096,
      "second_weight": 1.0,
      "thought_temperature": 0.6,
      "thought_top_p": 0.95,
      "thought_top_k": 20,
      "coverage": true,
      "confidence": "startlux"
    }
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import structlog

log = structlog.get_logger(__name__)

FILE_NAME = "decision_config.json"
QUESTION_TYPES = ("noul", "choice", "score")
CONFIDENCE_MODES = ("startlux", "max_probability")
ConfidenceMode = Literal["startlux", "max_probability"]


class DecisionConfigError(ValueError):
    """A decision config file or value that cannot be used; the message names the problem."""


def _number(name: str, value: Any) -> float:
    # bool is an int subclass; `"gate": true` is a typo, not 1.0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DecisionConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise DecisionConfigError(f"{name} must be finite, got {value!r}")
    return value


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecisionConfigError(f"{name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Temperatures:
    """Per-question-type read-out temperatures: letter logits are divided by these."""

    noul: float = 1.0
    choice: float = 1.0
    score: float = 1.0

    def __post_init__(self) -> None:
        for name in QUESTION_TYPES:
            value = _number(f"temperatures.{name}", getattr(self, name))
            if value <= 0.0:
                raise DecisionConfigError(f"temperatures.{name} must be > 0, got {value!r}")
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class DecisionConfig:
    """Everything besides the weights and the request that decides a record's numbers.

    - `temperatures`: read-out temperature per question type (StartLux's file; default 1.0).
    - `gate`: AutoThink threshold on the *top probability* of the first read-out; below it the
      model thinks and the letters are read again (StartLux's serving default 0.6). Requests
      and questions may override it.
    - `thought_budget`: most tokens a thought may use before `</think>` is forced (4096).
    - `second_weight`: w in p = (1 - w)·p_first + w·p_second. StartLux does not publish how it
      mixes; 1.0 means the post-thought read-out alone.
    - `thought_temperature`, `thought_top_p`, `thought_top_k`: sampling of the thought.
      Defaults 0.6 / 0.95 / 20 are Qwen's recommended thinking-mode settings (the Qwen3 cards'
      thinking setting, kept by the Qwen3.5 cards for precise reasoning tasks; their
      general-chat thinking setting is temperature 1.0 with a presence penalty). StartLux
      does not publish its own. `thought_top_k = 0` turns top-k off.
    - `coverage`: report the full-vocabulary mass on the listed letters.
    - `confidence`: "startlux" (the published per-type formulas) or "max_probability".
    """

    temperatures: Temperatures = field(default_factory=Temperatures)
    gate: float = 0.6
    thought_budget: int = 4096
    second_weight: float = 1.0
    thought_temperature: float = 0.6
    thought_top_p: float = 0.95
    thought_top_k: int = 20
    coverage: bool = True
    confidence: ConfidenceMode = "startlux"

    def __post_init__(self) -> None:
        if not isinstance(self.temperatures, Temperatures):
            raise DecisionConfigError(f"temperatures must be Temperatures, got {self.temperatures!r}")
        gate = _number("gate", self.gate)
        if not 0.0 <= gate <= 1.0:
            raise DecisionConfigError(f"gate must be in [0, 1], got {gate!r}")
        budget = _integer("thought_budget", self.thought_budget)
        if budget < 1:
            raise DecisionConfigError(f"thought_budget must be >= 1, got {budget!r}")
        weight = _number("second_weight", self.second_weight)
        if not 0.0 <= weight <= 1.0:
            raise DecisionConfigError(f"second_weight must be in [0, 1], got {weight!r}")
        temp = _number("thought_temperature", self.thought_temperature)
        if temp <= 0.0:
            raise DecisionConfigError(f"thought_temperature must be > 0, got {temp!r}")
        top_p = _number("thought_top_p", self.thought_top_p)
        if not 0.0 < top_p <= 1.0:
            raise DecisionConfigError(f"thought_top_p must be in (0, 1], got {top_p!r}")
        top_k = _integer("thought_top_k", self.thought_top_k)
        if top_k < 0:
            raise DecisionConfigError(f"thought_top_k must be >= 0 (0 = off), got {top_k!r}")
        if not isinstance(self.coverage, bool):
            raise DecisionConfigError(f"coverage must be true or false, got {self.coverage!r}")
        if self.confidence not in CONFIDENCE_MODES:
            raise DecisionConfigError(
                f"confidence must be one of {', '.join(CONFIDENCE_MODES)}, got {self.confidence!r}"
            )
        # Store normalised types so 1 and 1.0 give the same digest.
        for name, value in (
            ("gate", gate),
            ("second_weight", weight),
            ("thought_temperature", temp),
            ("thought_top_p", top_p),
        ):
            object.__setattr__(self, name, value)

    def temperature(self, question_type: str) -> float:
        if question_type not in QUESTION_TYPES:
            raise DecisionConfigError(
                f"unknown question type {question_type!r}; expected one of {', '.join(QUESTION_TYPES)}"
            )
        return getattr(self.temperatures, question_type)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["temperatures"] = {name: getattr(self.temperatures, name) for name in QUESTION_TYPES}
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "decision config") -> DecisionConfig:
        if not isinstance(data, dict):
            raise DecisionConfigError(f"{source}: top level must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DecisionConfigError(
                f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known keys are {', '.join(sorted(known))}"
            )
        kwargs = dict(data)
        if "temperatures" in kwargs:
            temps = kwargs["temperatures"]
            if not isinstance(temps, dict):
                raise DecisionConfigError(f"{source}: temperatures must be an object, got {temps!r}")
            bad = sorted(set(temps) - set(QUESTION_TYPES))
            if bad:
                raise DecisionConfigError(
                    f"{source}: unknown temperature key(s) {', '.join(map(repr, bad))}; "
                    f"known keys are {', '.join(QUESTION_TYPES)}"
                )
        try:
            if "temperatures" in kwargs:
                kwargs["temperatures"] = Temperatures(**kwargs["temperatures"])
            return cls(**kwargs)
        except DecisionConfigError as exc:
            raise DecisionConfigError(f"{source}: {exc}") from None

    def canonical_json(self) -> str:
        """Sorted keys, no whitespace, floats in Python's shortest round-trip form."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), allow_nan=False)

    def digest(self) -> str:
        """sha256 hex of `canonical_json()`: stable across runs, processes and key order."""
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()


def find_decision_config(model_path: str | os.PathLike[str]) -> Path | None:
    """The `decision_config.json` that belongs to a model: inside it if it is a directory,
    beside it if it is a file. None when there is none."""
    path = Path(model_path)
    candidate = path / FILE_NAME if path.is_dir() else path.parent / FILE_NAME
    return candidate if candidate.is_file() else None


def load_decision_config(path: str | os.PathLike[str] | None = None) -> DecisionConfig:
    """Load the decision config.

    - None: the defaults.
    - a `.json` file: that file (it must exist).
    - anything else (a model file or a model directory): the `decision_config.json` beside
      it or inside it; the defaults when there is none (logged, since the temperatures then
      are 1.0 rather than the model's own).
    """
    if path is None:
        return DecisionConfig()
    p = Path(path)
    if p.suffix.lower() == ".json":
        if not p.is_file():
            raise DecisionConfigError(f"decision config file not found: {p}")
        config_file = p
    else:
        if not p.exists():
            raise DecisionConfigError(f"model path not found: {p}")
        found = find_decision_config(p)
        if found is None:
            log.info("decision_config.defaults", model_path=str(p), looked_for=FILE_NAME)
            return DecisionConfig()
        config_file = found
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DecisionConfigError(f"{config_file}: cannot read decision config: {exc}") from None
    config = DecisionConfig.from_dict(data, source=str(config_file))
    log.info("decision_config.loaded", path=str(config_file), digest=config.digest())
    return config
