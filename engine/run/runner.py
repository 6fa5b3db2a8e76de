"""The runner an `ExecutionPath` names: forests through the one-pass body or the level executor,
and the thought decoder, built once per engine.

May import: `engine.run` (its siblings), `engine.model`.
"""

from __future__ import annotations

from engine.model.weights import Weights
from engine.run.body import ForestBody
from engine.run.decoder import Decoder
from engine.run.executor import ForestOutput, run_forest
from engine.run.forest import Forest
from engine.run.path import ExecutionPath


class Runner:
    """Runs forests and thought steps on one engine's weights along its path."""

    def __init__(self, weights: Weights, path: ExecutionPath) -> None:
        self.weights = weights
        self.path = path
        self.body = ForestBody(weights, graphs=path.graphs, **path.body_settings) if path.body else None  # type: ignore[arg-type]
        self._decoder: Decoder | None = None

    def forest(self, forest: Forest) -> ForestOutput:
        """One forest through the path's runner (the body's device tables, or level by level)."""
        if self.body is not None:
            return self.body.run(forest)
        return self.levels(forest)

    def levels(self, forest: Forest) -> ForestOutput:
        """One forest through the level executor whatever the path (image evidence: the body's
        device tables have no image rows)."""
        return run_forest(self.weights, forest, dtype=self.path.dtype)

    @property
    def decoder(self) -> Decoder:
        """The thought decoder (built on first use: its buffers are sized by the first thoughts)."""
        if self._decoder is None:
            self._decoder = Decoder(
                self.weights, graphs=self.path.graphs, attention_dots=self.path.decoder_dots
            )
        return self._decoder
