"""The engine a record's provenance names, found among given model files (by digest) or loaded
engines, or a refusal that names the difference."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from prism_pipeline.core.records import DecisionEngine
from prism_pipeline.offline.errors import ReplayError, ReplayRefused

log = structlog.get_logger(__name__)


class EngineSource:
    """Finds (loads once) the engine a record's provenance names, or refuses.

    `models` are candidate GGUF files (matched by file digest); `engines` are already loaded
    engines (tests, `prism demo`), matched by digest, precision and decision config digest.
    The decision config is `decision_config` (or the one beside the model), with the gate,
    thought budget and mixing weight the record names; its digest must equal the record's.
    """

    def __init__(
        self,
        models: Sequence[Path] = (),
        *,
        decision_config: Path | None = None,
        device: str = "cpu",
        precision: str | None = None,
        engines: Sequence[DecisionEngine] = (),
        cache_bytes: int | None = None,
    ) -> None:
        self.models = list(models)
        self.decision_config = decision_config
        self.device = device
        self.precision = precision
        self.cache_bytes = cache_bytes
        self._digests: dict[tuple[Path, Path | None], str] | None = None
        self._engines: list[DecisionEngine] = list(engines)
        self.notes: list[str] = []

    def _model_digests(self) -> dict[tuple[Path, Path | None], str]:
        """(model, projector or None) -> the digest a record decided with them names. A model
        with an mmproj-*.gguf beside it also matches records decided with that projector."""
        if self._digests is None:
            from engine.loading import model_digest
            from engine.vision.mmproj import find_mmproj

            self._digests = {}
            for p in self.models:
                if not p.is_file():
                    raise ReplayError(f"--model {p}: no such file")
                self._digests[(p, None)] = model_digest(p)
                mmproj = find_mmproj(p)
                if mmproj is not None:
                    self._digests[(p, mmproj)] = model_digest(p, mmproj)
        return self._digests

    def engine_for(self, model: dict[str, Any] | None, what: str) -> DecisionEngine:
        if model is None:
            raise ReplayRefused(f"{what}: the record has no model provenance")
        try:
            digest, precision = str(model["file_digest"]), str(model["precision"])
            cfg_digest = str(model["decision_config_digest"])
            name = str(model.get("name"))
        except KeyError as e:
            raise ReplayRefused(f"{what}: the record's provenance lacks {e}") from None
        if self.precision is not None and self.precision != precision:
            raise ReplayRefused(
                f"{what} was decided on the {precision} path; replay was asked to use {self.precision} "
                "(records are only reproducible on the path that made them)"
            )
        for e in self._engines:
            if (e.model_digest, e.precision, e.decision_config.digest()) == (digest, precision, cfg_digest):
                self._check_versions(e, model)
                return e
        candidates = [files for files, d in self._model_digests().items() if d == digest]
        if not candidates and not self.models and not self._engines:
            raise ReplayRefused(
                f"{what} was decided by model {name!r} with file sha256 {digest}; "
                "pass that model file with --model"
            )
        if not candidates:
            given = (
                ", ".join(
                    f"{p}{f' + {m}' if m else ''} (sha256 {d})" for (p, m), d in self._model_digests().items()
                )
                or "none"
            )
            loaded = ", ".join(f"{e.model_name} (sha256 {e.model_digest})" for e in self._engines)
            raise ReplayRefused(
                f"{what} was decided by model {name!r} with file sha256 {digest}; the model file(s) given "
                f"differ: {given}{'; loaded: ' + loaded if loaded else ''}. "
                "Pass the same model file with --model."
            )
        path, mmproj = candidates[0]
        cfg = self._config_for(path, model, what)
        from prism_pipeline.core.engine_setup import EngineSettings, load_engine

        log.info("replay.loading_model", path=str(path), precision=precision, digest=digest)
        settings = EngineSettings(model=path, device=self.device, precision=precision)  # type: ignore[arg-type]
        engine = load_engine(
            settings,
            decision_config=cfg,  # the one the record names
            mmproj=mmproj or False,  # exactly the files the record names: a projector or none
            cache_bytes=self.cache_bytes,
            watch=False,
        )
        self._engines.append(engine)
        self._check_versions(engine, model)
        return engine

    def _check_versions(self, engine: DecisionEngine, model: dict[str, Any]) -> None:
        # Not a refusal: a new engine version may well reproduce old records. A difference
        # found under a changed renderer or engine is explained by this note.
        for key, mine in (
            ("engine_version", engine.engine_version),
            ("render_version", engine.render_version),
        ):
            theirs = model.get(key)
            note = f"records name {key} {theirs!r}; this replay runs {mine!r}"
            if theirs != mine and note not in self.notes:
                self.notes.append(note)

    def _config_for(self, path: Path, model: dict[str, Any], what: str) -> Any:
        from engine.decide.decision_config import DecisionConfigError, load_decision_config

        source = self.decision_config or path
        try:
            base = load_decision_config(source)
            cfg = dataclasses.replace(
                base,
                gate=float(model["gate"]),
                thought_budget=int(model["thought_budget"]),
                second_weight=float(model["mix_weight"]),
            )
        except (DecisionConfigError, KeyError, TypeError, ValueError) as e:
            raise ReplayRefused(f"{what}: cannot rebuild its decision config from {source}: {e}") from None
        if cfg.digest() != model["decision_config_digest"]:
            raise ReplayRefused(
                f"{what} was decided under decision config sha256 {model['decision_config_digest']}; "
                f"{source} with the record's gate/thought budget/mixing weight gives {cfg.digest()} "
                "(temperatures or thought sampling differ). Pass the worker's decision_config.json "
                "with --decision-config."
            )
        return cfg
