"""One engine setup for every command: `EngineSettings` (model, projector, decision config,
device, precision path, tensor parallelism, cache, gate, thought budget) and `load_engine`.

`prism run`, `serve`, `backfill`, `replay` and `demo` all load their engine here, so a flag means
the same under each. In particular `--gate` and `--thought-budget` are always changes to the
decision config (never per-request overrides): they enter the config digest, and every record
names the gate, thought budget and mixing weight it was decided under (`model.gate`,
`model.thought_budget`, `model.mix_weight`, `model.decision_config_digest`), which is what
`prism replay` rebuilds the config from. An event's or a question's own `gate` overrides the
config's default for that event, below the operator's `--max-gate` ceiling.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from prism_pipeline.core.records import DecisionEngine

Precision = Literal["auto", "int8", "bf16", "fp32"]
PRECISIONS: tuple[str, ...] = ("auto", "int8", "bf16", "fp32")  # auto: int8 on CUDA, fp32 elsewhere
PATHS: tuple[str, ...] = PRECISIONS[1:]


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


class EngineSettings(BaseSettings):
    """What loads an engine; CLI flags win over `PRISM_*` environment variables over defaults."""

    model_config = SettingsConfigDict(env_prefix="PRISM_", extra="forbid")

    model: Path | None = Field(None, description="StartLux-Decision GGUF model file")
    mmproj: Path | None = Field(
        None, description="vision projector GGUF for images (default: an mmproj-*.gguf beside the model)"
    )
    decision_config: Path | None = Field(None, description="decision_config.json (default: beside the model)")
    device: str = Field("cpu", description="engine device: cpu, cuda or cuda:N")
    precision: Precision = Field("auto", description="precision path; auto is int8 on CUDA and fp32 on CPU")
    tp: int = Field(1, ge=1, description="tensor-parallel devices (int8; cuda -> cuda:0..N-1)")
    gate: float | None = Field(
        None,
        ge=0,
        le=1,
        description="AutoThink gate of the decision config (default: the model's; records name it)",
    )
    thought_budget: int | None = Field(
        None,
        ge=0,
        description=(
            "AutoThink thought token budget (unset: the decision config's, 4096 by default), also the "
            "most an event may ask for; a thinking batch logs engine.thinking every 10 s, and a "
            "thought that never closes is reported (engine.thought_unclosed)"
        ),
    )

    def resolved_precision(self) -> str:
        """The precision path `auto` stands for on this device: the engine's one default."""
        if self.precision != "auto":
            return self.precision
        from engine.run.path import default_precision

        return default_precision(self.device)


def decision_config_for(settings: EngineSettings) -> Any:
    """The model's decision config with the gate / thought-budget settings applied.

    They go into the config (not into each request) so they are covered by the config digest
    every record carries: a replay under a different gate is detected.
    """
    from engine.decide.decision_config import load_decision_config

    cfg = load_decision_config(settings.decision_config or settings.model)
    changes: dict[str, Any] = {}
    if settings.gate is not None:
        changes["gate"] = settings.gate
    if settings.thought_budget is not None:
        changes["thought_budget"] = settings.thought_budget
    return dataclasses.replace(cfg, **changes) if changes else cfg


def load_engine(
    settings: EngineSettings,
    *,
    decision_config: Any = None,
    mmproj: Path | bool | None = None,
    cache_bytes: int | None = None,
    watch: bool = True,
) -> DecisionEngine:
    """Load the engine `settings` name (errors about the files: `ConfigError`).

    `decision_config` replaces the settings' config whole (replay: the one a record names);
    `mmproj` False loads no projector even if one lies beside the model; `watch` wraps the engine
    in `ThoughtWatch` (progress while thinking; the HTTP server hands results over early instead).
    """
    if settings.model is None:
        raise ConfigError("no model: pass --model PATH or set PRISM_MODEL")
    if not settings.model.is_file():
        raise ConfigError(f"model file not found: {settings.model}")
    from engine.engine import Engine

    engine = Engine.load(
        settings.model,
        device=settings.device,
        precision=settings.resolved_precision(),
        decision_config=decision_config if decision_config is not None else decision_config_for(settings),
        tp=settings.tp,
        cache_bytes=cache_bytes,
        mmproj=settings.mmproj if mmproj is None else mmproj,  # None: found beside the model, or none
    )
    if not watch:
        return engine
    from prism_pipeline.core.thoughtwatch import ThoughtWatch

    return ThoughtWatch(engine)
