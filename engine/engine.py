"""`Engine`: load a StartLux-Decision GGUF and decide typed questions about evidence (the facade).

What lives where, top-down:
- `engine.stages`: a decide call's stages (forests of evidence and question segments, rounds,
  the prefix cache, images) and `engine.thoughts`, AutoThink's one thought loop;
  `engine.questions`: a question's progress and the records built from it.
- `engine.run`: execution (the path chosen at load, `engine.run.path`; the level executor, the
  one-pass body, the decoder, tensor parallelism); `engine.quant`: the int8 weights;
  `engine.model`: the GGUF file, tokenizer and prompt; `engine.decide`: read-outs, answers,
  sampling, the decision config; `engine.kernels`: the Triton kernels.
- `engine.loading`: the tokenizer, digest and projector `load` reads; `engine.ranks`: rank 0 and
  its tensor-parallel followers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog
import torch

from engine.cache import PrefixCache, default_budget
from engine.decide.decision_config import DecisionConfig
from engine.loading import (
    MAX_REQUEST_TOKENS,
    LoadOptions,
    decision_config_of,
    model_digest,
    tokenizer_from_gguf,
    vision_for,
)
from engine.model.config import ModelConfig
from engine.model.gguf import open_gguf
from engine.model.loader import load_weights
from engine.model.prompt import RENDER_VERSION, PromptEncoder, render_parts_for_state_text, render_state
from engine.model.tokenizer import Tokenizer
from engine.model.weights import Weights
from engine.quant.calibration import DEFAULT_ALPHA, QuantReport, is_int8, requantize
from engine.questions import first_group
from engine.ranks import start_followers
from engine.run.body import ForestBody
from engine.run.executor import ForestCounters
from engine.run.path import ExecutionPath, Precision, choose_path, dtype_for
from engine.run.reference import forward
from engine.run.runner import Runner
from engine.run.tp import Followers, TensorParallel, close_group, shard_weights, weights_digest
from engine.stages import Mode, Stages
from engine.types import DecideRequest, DecideResult
from engine.vision.mmproj import VisionWeights
from engine.vision.preprocess import ImageLimits
from schemas.record import Readout
from schemas.systemone import SystemOneRequest

log = structlog.get_logger(__name__)

# Records name it; a replay under another version notes the change. 0.2.0: a CUDA read-out's
# coverage is summed on the device in fixed-order chunks (engine.kernels.vocab_mass), which
# moves its last bits; RoPE angles come from a per-position table (engine.run.rope). 0.3.0: CUDA int8
# runs the one-pass body by default, and the coverage sums are exact integer-limb sums; thought
# draws are keyed by content (seed, evidence digest, question tokens), not by event id and
# question key (engine.decide.sampling.thought_key): every thought, and so its second read-out, moves.
# 0.4.0: CUDA thoughts decode with the body's attention dots (bf16 on the CUDA default), and a
# top-k draw is plain float64 Python arithmetic (engine.decide.sampling._draw): CUDA thoughts move.
# 0.5.0: the CUDA body's chunk-64 GDN products come from whole-chunk products and a blocked
# inverse (`gdn_prep` "auto": the invert form at head sizes that are multiples of 64, every
# released size): CUDA read-outs and thoughts move by rounding; CPU records keep their bits.
# 0.6.0: the long attention tier's own causal blocks run in CUTLASS's Hopper FMHA kernel on CUDA
# where the CUTLASS library is built (`forest_attention.FMHA_LONG_TIER`, another tile and softmax
# order: segments of 1,024 tokens or more at head 256), after other CUDA kernel changes since
# 0.5.0 that also round differently (the fused norm's sum of squares in 16-byte blocks,
# `quant.NORM_BLOCK_VALUES`): CUDA read-outs and thoughts move by rounding; CPU records keep their bits.
# A top-k draw's exp and sums are IEEE basic operations only (`engine.decide.portable_exp`, left
# to right), so a draw gives the same token on any machine: a thought moves only where its u
# lay within float64 rounding of an option's boundary.
ENGINE_VERSION = "0.6.0"
# An image is resized to at most this many pixels (2 MP: 2,048 image tokens with 16-pixel patches
# merged 2x2; a 1,024 x 768 screenshot keeps its size, 768 tokens). The model's own bound is 16 MP.
DEFAULT_MAX_IMAGE_PIXELS = 2_097_152


class Engine:
    engine_version = ENGINE_VERSION
    render_version = RENDER_VERSION

    def __init__(
        self,
        *,
        weights: Weights,
        tokenizer: Tokenizer,
        decision_config: DecisionConfig,
        precision: Precision | None = None,
        model_name: str = "model",
        model_digest: str = "0" * 64,
        device: str = "cpu",
        cache_bytes: int | None = None,
        smooth_alpha: float = DEFAULT_ALPHA,
        tp: TensorParallel | None = None,
        body: bool | None = None,
        decoder: bool | None = None,
        body_settings: Mapping[str, int | str] | None = None,
        decoder_dots: str | None = None,
        vision: VisionWeights | None = None,
        image_limits: ImageLimits | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        max_request_tokens: int = MAX_REQUEST_TOKENS,
    ) -> None:
        """The execution path is chosen here, once (`engine.run.path.choose_path`: precision,
        dtype, body or level executor, decoder or forest thought steps, the body's settings, the
        decoder's attention dots); every None takes its default. `max_request_tokens`: a request
        needing more tokens in its first stage is rejected, not run for minutes."""
        self.path: ExecutionPath = choose_path(
            device,
            precision,
            body=body,
            decoder=decoder,
            body_settings=body_settings,
            decoder_dots=decoder_dots,
            tensor_parallel=tp is not None,
        )
        # int8: requantize once at startup (calibrate, smooth, quantize); see engine.quant.calibration.
        self.quant_report: QuantReport | None = None
        if self.path.precision == "int8" and not is_int8(weights):
            weights, self.quant_report = requantize(
                weights, PromptEncoder(tokenizer), alpha=smooth_alpha, device=device
            )
        # Tensor parallel: every rank requantized the same file the same way (checked), then
        # keeps its slice; decide() calls are broadcast from rank 0 (see engine.ranks).
        self.tp = tp
        self.followers: Followers | None = None
        if tp is not None:
            digest = weights_digest(weights)
            if tp.broadcast(digest) != digest:
                raise RuntimeError(f"rank {tp.rank} quantized the model differently from rank 0")
            weights = shard_weights(weights, tp)
            budget = default_budget(self.path.device) if cache_bytes is None else cache_bytes
            cache_bytes = tp.broadcast(budget)  # every rank must make the same cache decisions
        self.weights = weights
        self.config: ModelConfig = weights.config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_digest = model_digest
        self.runner = Runner(weights, self.path)
        # Images (engine.vision): the tower from the mmproj file, on this engine's device. Without
        # it, requests with images are rejected. An image is resized to at most max_image_pixels
        # (below the model's own bound when that is larger: it caps a request's image tokens).
        t0 = time.perf_counter()
        self.stages = Stages(
            runner=self.runner,
            tokenizer=tokenizer,
            decision_config=decision_config,
            cache=PrefixCache(default_budget(self.path.device) if cache_bytes is None else cache_bytes),
            tp=tp,
            max_request_tokens=max_request_tokens,
            vision=vision.to(self.path.device) if vision is not None else None,
            image_limits=image_limits or ImageLimits(),
            max_image_pixels=(
                min(max_image_pixels, vision.config.max_pixels) if vision is not None else max_image_pixels
            ),
        )
        log.info(
            "system_segment_ready", tokens=self.stages.root.length, seconds=round(time.perf_counter() - t0, 3)
        )
        # what callers read (fixed at load: the path is frozen, the objects are the stages' own)
        self.precision: Precision = self.path.precision
        self.device, self.dtype = self.path.device, self.path.dtype
        self.body: ForestBody | None = self.runner.body  # the one-pass body when the path runs one
        self.decision_config, self.max_request_tokens = decision_config, max_request_tokens
        self.cache, self.prompts, self.root, self.vision = (
            self.stages.cache,
            self.stages.prompts,
            self.stages.root,
            self.stages.vision,
        )

    @property
    def last_counters(self) -> list[ForestCounters]:
        """The forests the last decide call ran (one entry per forest)."""
        return self.stages.last_counters

    # ------------------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str = "cpu",
        precision: Precision | None = None,
        decision_config: str | Path | DecisionConfig | None = None,
        cache_bytes: int | None = None,
        smooth_alpha: float = DEFAULT_ALPHA,
        tp: int | TensorParallel = 1,
        body: bool | None = None,
        mmproj: str | Path | bool | None = None,
        *,
        decoder: bool | None = None,
        body_settings: Mapping[str, int | str] | None = None,
        decoder_dots: str | None = None,
        max_request_tokens: int = MAX_REQUEST_TOKENS,
    ) -> Engine:
        """precision None: int8 on CUDA, fp32 elsewhere. smooth_alpha: SmoothQuant strength (int8 only).
        body, decoder, body_settings, decoder_dots: the execution path's choices (None: the
        defaults, `engine.run.path.choose_path`). mmproj: the vision projector GGUF (images in
        evidence); None finds one next to the model by llama.cpp's naming (`mmproj-*.gguf`,
        `engine.vision.mmproj.find_mmproj`); False: none.

        tp > 1 runs the model over `tp` devices (cuda -> cuda:0..tp-1; cpu -> gloo processes):
        this process is rank 0 and starts the others, which serve its `decide` calls until
        `close()`. Results are bit-identical to tp=1 (int8 only).
        """
        options = LoadOptions(
            precision=precision,
            decision_config=decision_config,
            cache_bytes=cache_bytes,
            smooth_alpha=smooth_alpha,
            body=body,
            decoder=decoder,
            body_settings=body_settings,
            decoder_dots=decoder_dots,
            mmproj=mmproj,
            max_request_tokens=max_request_tokens,
        )
        followers = None
        group: TensorParallel | None = tp if isinstance(tp, TensorParallel) else None
        if isinstance(tp, int):
            if tp < 1:
                raise ValueError(f"tp must be >= 1, got {tp}")
            if tp > 1:
                device, group, followers = start_followers(tp, device, path, options, cls)
        try:
            engine = cls.load_rank(path, device, options, group)
        except BaseException:
            if followers is not None:
                followers.join(timeout=5.0)
                close_group()
            raise
        engine.followers = followers
        return engine

    @classmethod
    def load_rank(
        cls, path: str | Path, device: str, options: LoadOptions, tp: TensorParallel | None = None
    ) -> Engine:
        """One rank's engine (the whole engine without tensor parallelism)."""
        path = Path(path)
        precision = choose_path(device, options.precision).precision
        t0 = time.perf_counter()
        file = open_gguf(path)
        file.config()  # architecture and hyper-parameters first: a clear error for a foreign file
        tokenizer = tokenizer_from_gguf(file)
        weights = load_weights(file, dtype=dtype_for(precision))
        dc = decision_config_of(options.decision_config, path)
        name = str(file.metadata.get("general.name") or path.stem)
        vision, mmproj_path = vision_for(path, weights.config.hidden_size, options.mmproj)
        engine = cls(
            weights=weights,
            tokenizer=tokenizer,
            decision_config=dc,
            precision=precision,
            model_name=name,
            model_digest=model_digest(path, mmproj_path),
            device=device,
            tp=tp,
            vision=vision,
            **options.engine_arguments(),
        )
        log.info(
            "engine_loaded", path=str(path), precision=precision, seconds=round(time.perf_counter() - t0, 3)
        )
        return engine

    # ------------------------------------------------------------------------------ plain API
    def logits(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Full-sequence logits [len, vocab] float32: a plain forward from the sequence start."""
        if self.tp is not None:
            raise ValueError("Engine.logits needs whole weights: not under tensor parallelism")
        return forward(self.weights, [int(t) for t in token_ids], dtype=self.dtype)

    def count_tokens(self, request: SystemOneRequest) -> int:
        """Tokens the request adds to a forest batch: evidence once plus each question's own."""
        stages = self.stages
        state_text = render_state(request.state)
        total = len(self.prompts.evidence_ids(state_text))
        if request.images and self.vision is not None:
            # checks every image (an ImageError, a ValueError, names the bad one): the pipeline and
            # the server call this before batching, so a hostile image never reaches a batch
            total += len(stages.image_set(request).tokens(stages.vision_tokens))  # type: ignore[arg-type]
        for question in request.questions.values():
            parts = render_parts_for_state_text(state_text, question, first_group(question))
            total += len(self.prompts.question_ids(parts.question_text))
        return total

    def read_with_thought(self, request: SystemOneRequest, qid: str, thought_ids: list[int]) -> Readout:
        """The letters read after a given thought: question `qid` of `request` with `<think>\\n`,
        `thought_ids`, then `</think>\\n\\n` (the closing `decide` feeds after a thought).

        Why: comparing precision paths needs a thought written by one path read by another
        (`prism eval`'s cross-read matrix). The prompt is the one `decide` thinks on; the tokens
        run as one segment from the evidence instead of one per step, so on the reference paths
        the result matches `decide`'s second read-out to float rounding, not bit for bit.
        """
        return self.read_with_thoughts([(request, qid, thought_ids)])[0]

    def read_with_thoughts(self, reads: list[tuple[SystemOneRequest, str, list[int]]]) -> list[Readout]:
        """`read_with_thought` for many (request, question id, thought) at once: one forest, each
        distinct evidence once."""
        if self.tp is not None:
            raise ValueError("read_with_thought runs on one device, not under tensor parallelism")
        return self.stages.read_with_thoughts(reads)

    # ------------------------------------------------------------------------------ decide
    def decide(
        self,
        requests: list[DecideRequest],
        *,
        mode: Mode = "forest",
        on_ready: Callable[[int, DecideResult], None] | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> list[DecideResult]:
        """One result per request. `on_ready(i, result)` (rank 0 only) hands over request i's result
        as soon as it is final - after the first read-outs for a request none of whose questions
        think - so a short request batched with long thoughts need not wait for them; the same
        result object is in the returned list. `between_steps()` runs before each thought step
        (rank 0, no tensor parallelism): a caller may run another `decide` in it for requests that
        cannot think (their first stage touches no thought state), so short work interleaves
        with long thoughts; the int8 bits are the same either way."""
        if mode not in ("forest", "per_question"):
            raise ValueError(f"mode must be 'forest' or 'per_question', got {mode!r}")
        if self.tp is not None:
            if self.followers is None:
                raise RuntimeError("decide() runs on rank 0 of a tensor-parallel group, which is closed")
            self.followers.send(("decide", requests, mode))
        if between_steps is not None and self.tp is not None:
            raise ValueError("between_steps cannot interleave work under tensor parallelism")
        return self.stages.decide(requests, mode, on_ready, between_steps)

    def decide_as_follower(self, requests: list[DecideRequest], mode: Mode) -> None:
        """A follower rank's part of rank 0's `decide` call (`engine.ranks.follow`)."""
        self.stages.decide(requests, mode)

    def close(self) -> None:
        """Stop the follower ranks and leave the process group (no-op without tensor parallelism)."""
        if self.tp is not None and self.followers is not None:
            self.followers.join()
            self.followers = None
            close_group()
