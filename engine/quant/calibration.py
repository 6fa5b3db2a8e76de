"""Startup requantization for the int8 path: calibrate, smooth, quantize.

1. Calibration: the prompts shipped in `engine/data/calibration_prompts.jsonl` (AIOps alerts
   and tickets with typed questions) are rendered with the engine's own renderer and run
   through the fp32 forest executor as one forest (system root, evidence, questions) whose
   linear weights are wrapped in observers that record each input channel's absmax. The
   stats therefore come from exactly the positions the engine computes at serving time
   (every token, except that the last layer and the LM head only see read positions).
2. SmoothQuant scales per input group (one s for every linear reading the same activation).
3. Folding: s goes into the RMSNorm that produces the input where there is one
   (attn_norm -> attn_q/k/v or attn_qkv/attn_gate/ssm_alpha/ssm_beta; post_attention_norm ->
   ffn_gate/ffn_up; output_norm -> LM head); ffn_down, attn_output and ssm_out divide their
   input by s inside `QuantLinear`.
4. Every linear becomes a `QuantLinear` (int8 per output channel), the LM head included. The
   embedding, norms, conv and GDN parameters stay float; with tied embeddings the embedding
   stays the float table and the LM head gets its own int8 copy.

Dequantizing Q8_0 to fp32 is exact (fp16 scale x int8 value), so requantizing from the
loaded fp32 weights loses nothing a direct Q8_0 -> int8 path would keep.
"""

from __future__ import annotations

import json
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import structlog
import torch

from engine.model.prompt import PromptEncoder, render_parts_for_state_text, render_state
from engine.model.weights import Weights
from engine.quant.linear import QuantLinear, SmoothedLinear, fold_smoothing, quantize_linear, smooth_scales
from engine.run.executor import run_forest
from engine.run.forest import Segment, build_forest
from schemas.systemone import SystemOneRequest

log = structlog.get_logger(__name__)

DEFAULT_ALPHA = 0.5
PROMPTS_RESOURCE = "calibration_prompts.jsonl"
LM_HEAD = "output"

# Input groups: linears that read the same activation, and the norm that produces it (if any).
_NORM_GROUPS_FULL = {
    "attn_norm": ("attn_q", "attn_k", "attn_v"),
    "post_attention_norm": ("ffn_gate", "ffn_up"),
}
_NORM_GROUPS_LINEAR = {
    "attn_norm": ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta"),
    "post_attention_norm": ("ffn_gate", "ffn_up"),
}
_EXPLICIT_FULL = ("attn_output", "ffn_down")
_EXPLICIT_LINEAR = ("ssm_out", "ffn_down")


@dataclass(frozen=True)
class QuantReport:
    """What requantization cost and produced (also logged as `int8_requantized`)."""

    alpha: float
    calibration_prompts: int
    calibration_tokens: int
    calibration_s: float
    quantize_s: float
    int8_bytes: int  # int8 weights + scales + smoothing vectors
    float_bytes_replaced: int  # fp32 linear weights the int8 ones replace
    peak_rss_mib: float  # process peak resident memory after requantization (host)
    device: str

    @property
    def seconds(self) -> float:
        return self.calibration_s + self.quantize_s


# ------------------------------------------------------------------------ prompts
def load_calibration_requests(path: str | Path | None = None) -> list[SystemOneRequest]:
    """The calibration requests (one JSON SystemOne request per line), validated."""
    if path is None:
        text = resources.files("engine.data").joinpath(PROMPTS_RESOURCE).read_text(encoding="utf-8")
        where = f"engine/data/{PROMPTS_RESOURCE}"
    else:
        text = Path(path).read_text(encoding="utf-8")
        where = str(path)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(SystemOneRequest.model_validate(json.loads(line)))
        except ValueError as e:
            raise ValueError(f"{where}:{n}: not a valid calibration request: {e}") from e
    if not out:
        raise ValueError(f"{where}: no calibration requests")
    return out


def calibration_segments(encoder: PromptEncoder, requests: Sequence[SystemOneRequest]) -> list[Segment]:
    """One forest: the system root, each request's evidence under it, each question under that."""
    segments = [Segment(tuple(encoder.prefix_ids), None)]
    for req in requests:
        state_text = render_state(req.state)
        ev = len(segments)
        segments.append(Segment(tuple(encoder.evidence_ids(state_text)), 0))
        for question in req.questions.values():
            parts = render_parts_for_state_text(state_text, question)
            segments.append(Segment(tuple(encoder.question_ids(parts.question_text)), ev, read=True))
    return segments


# ------------------------------------------------------------------------ statistics
class _Observer:
    """A float linear that records the per-input-channel absmax of everything it sees."""

    def __init__(self, weight: torch.Tensor, stats: dict[str, torch.Tensor], name: str) -> None:
        self.weight, self.stats, self.name = weight, stats, name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel():
            seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            old = self.stats.get(self.name)
            self.stats[self.name] = seen if old is None else torch.maximum(old, seen)
        return x @ self.weight.to(x.dtype).T


def _linear_keys(weights: Weights, layer: int) -> list[str]:
    full = weights.config.is_full_attention(layer)
    groups = _NORM_GROUPS_FULL if full else _NORM_GROUPS_LINEAR
    explicit = _EXPLICIT_FULL if full else _EXPLICIT_LINEAR
    return [k for keys in groups.values() for k in keys] + list(explicit)


def stat_name(layer: int | None, key: str) -> str:
    return key if layer is None else f"blk.{layer}.{key}"


def activation_stats(weights: Weights, segments: Sequence[Segment]) -> dict[str, torch.Tensor]:
    """Per-linear input absmax [in_features] (names `blk.{i}.{key}`, `output`) over one fp32 forest run."""
    stats: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer in enumerate(weights.layers):
        wrapped = dict(layer)
        for key in _linear_keys(weights, i):
            wrapped[key] = _Observer(layer[key], stats, stat_name(i, key))
        layers.append(wrapped)
    observed = Weights(
        config=weights.config,
        token_embd=weights.token_embd,
        output_norm=weights.output_norm,
        output=_Observer(weights.output, stats, LM_HEAD),  # type: ignore[arg-type]
        layers=layers,
    )
    with torch.no_grad():
        run_forest(observed, build_forest(segments), dtype=torch.float32, segmentwise=False)
    return stats


# ------------------------------------------------------------------------ quantization
def _group_stats(stats: dict[str, torch.Tensor], layer: int | None, keys: Sequence[str]) -> torch.Tensor:
    missing = [stat_name(layer, k) for k in keys if stat_name(layer, k) not in stats]
    if missing:
        raise ValueError(f"no calibration statistics for {missing}: the calibration pass never reached them")
    return torch.stack([stats[stat_name(layer, k)] for k in keys]).amax(dim=0)


def smooth_weights(weights: Weights, stats: dict[str, torch.Tensor], alpha: float = DEFAULT_ALPHA) -> Weights:
    """The SmoothQuant-transformed float model: same function, activations with flatter channels.

    Norm-fed groups get s folded into their norm and weights; ffn_down, attn_output and ssm_out
    become `SmoothedLinear`s. alpha = 0 returns the weights unchanged (as a new `Weights`).
    `weights` is not modified (folded norms are new tensors; a tied embedding stays as it was).
    """
    layers: list[dict[str, Any]] = []
    for i, layer in enumerate(weights.layers):
        full = weights.config.is_full_attention(i)
        out: dict[str, Any] = dict(layer)
        for norm_key, keys in (_NORM_GROUPS_FULL if full else _NORM_GROUPS_LINEAR).items():
            ws = [layer[k] for k in keys]
            s = smooth_scales(_group_stats(stats, i, keys), ws, alpha)
            if s is not None:
                out[norm_key], folded = fold_smoothing(layer[norm_key], ws, s)
                out.update(zip(keys, folded, strict=True))
        for key in _EXPLICIT_FULL if full else _EXPLICIT_LINEAR:
            s = smooth_scales(_group_stats(stats, i, [key]), [layer[key]], alpha)
            if s is not None:
                out[key] = SmoothedLinear(layer[key].float() * s[None, :], s)
        layers.append(out)
    head, output_norm = weights.output, weights.output_norm
    s = smooth_scales(_group_stats(stats, None, [LM_HEAD]), [head], alpha)
    if s is not None:
        output_norm, (head,) = fold_smoothing(output_norm, [head], s)
    return Weights(
        config=weights.config,
        token_embd=weights.token_embd,
        output_norm=output_norm,
        output=head,
        layers=layers,
    )


def quantize_weights(
    weights: Weights, stats: dict[str, torch.Tensor], alpha: float = DEFAULT_ALPHA
) -> Weights:
    """`smooth_weights`, then every linear (LM head included) as an int8 `QuantLinear`."""
    smoothed = smooth_weights(weights, stats, alpha)
    layers = []
    for i, layer in enumerate(smoothed.layers):
        keys = set(_linear_keys(weights, i))
        layers.append({k: quantize_linear(v) if k in keys else v for k, v in layer.items()})
    return Weights(
        config=smoothed.config,
        token_embd=smoothed.token_embd,
        output_norm=smoothed.output_norm,
        output=quantize_linear(smoothed.output),  # type: ignore[arg-type]
        layers=layers,
    )


def weights_to(weights: Weights, device: torch.device | str) -> Weights:
    """Every tensor (float or QuantLinear) of `weights` moved to `device`."""

    def move(t: Any) -> Any:
        return t.to(device)

    return Weights(
        config=weights.config,
        token_embd=move(weights.token_embd),
        output_norm=move(weights.output_norm),
        output=move(weights.output),
        layers=[{k: move(v) for k, v in layer.items()} for layer in weights.layers],
    )


def is_int8(weights: Weights) -> bool:
    return isinstance(weights.output, QuantLinear)


def requantize(
    weights: Weights,
    encoder: PromptEncoder,
    *,
    alpha: float = DEFAULT_ALPHA,
    device: torch.device | str = "cpu",
    prompts: str | Path | None = None,
) -> tuple[Weights, QuantReport]:
    """fp32 `weights` -> int8 weights on `device`, calibrated on the shipped (or given) prompts."""
    device = torch.device(device)
    t0 = time.perf_counter()
    requests = load_calibration_requests(prompts)
    segments = calibration_segments(encoder, requests)
    float_weights = weights_to(weights, device) if device.type != "cpu" else weights
    stats = activation_stats(float_weights, segments) if alpha > 0 else _empty_stats(weights)
    t1 = time.perf_counter()
    quantized = weights_to(quantize_weights(float_weights, stats, alpha), device)
    t2 = time.perf_counter()
    int8_bytes = sum(
        w.nbytes
        for w in [quantized.output, *(v for lay in quantized.layers for v in lay.values())]
        if isinstance(w, QuantLinear)
    )
    replaced = sum(
        w.numel() * 4
        for w in [
            weights.output,
            *(lay[k] for i, lay in enumerate(weights.layers) for k in _linear_keys(weights, i)),
        ]
    )
    report = QuantReport(
        alpha=alpha,
        calibration_prompts=len(requests),
        calibration_tokens=sum(len(s.tokens) for s in segments) if alpha > 0 else 0,
        calibration_s=t1 - t0,
        quantize_s=t2 - t1,
        int8_bytes=int8_bytes,
        float_bytes_replaced=replaced,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        device=str(device),
    )
    log.info(
        "int8_requantized",
        alpha=alpha,
        prompts=report.calibration_prompts,
        tokens=report.calibration_tokens,
        calibration_s=round(report.calibration_s, 3),
        quantize_s=round(report.quantize_s, 3),
        int8_mib=round(int8_bytes / 2**20, 2),
        float_mib_replaced=round(replaced / 2**20, 2),
        peak_rss_mib=round(report.peak_rss_mib, 1),
        device=str(device),
    )
    return quantized, report


def _empty_stats(weights: Weights) -> dict[str, torch.Tensor]:
    """Stand-in statistics for alpha = 0, where smoothing is off and no calibration pass is needed."""
    stats = {LM_HEAD: torch.ones(weights.config.hidden_size)}
    for i, layer in enumerate(weights.layers):
        for key in _linear_keys(weights, i):
            stats[stat_name(i, key)] = torch.ones(layer[key].shape[1])
    return stats
