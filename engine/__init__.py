"""Prism's inference engine for StartLux-Decision (qwen35) GGUF models."""

from engine.engine import Engine
from engine.types import DecideRequest, DecideResult

__all__ = ["DecideRequest", "DecideResult", "Engine"]
