"""`Engine`: load a StartLux-Decision GGUF and decide typed questions about evidence.

`decide` runs in stages. Each stage is one packed forest: the evidence segments of the
requests that still have reads pending (first stage only: later stages reuse the evidence
states kept from the first), and one question segment per pending read. Stages exist for
choice questions with more than 26 options (rounds) and for AutoThink (thought decoding
and the second read-out). The system segment runs once, when the engine loads.

`mode="per_question"` renders every read as its own full prompt with no sharing at all:
the oracle the forest is tested against.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import structlog
import torch

from engine.cache import PrefixCache, default_budget, prefix_key
from engine.decide.answers import answer_for
from engine.decide.decision_config import DecisionConfig, load_decision_config
from engine.decide.readout import ChoiceRounds, LetterReadout, mix_probabilities, read_letters
from engine.decide.sampling import sample_tokens, thought_key, uniform
from engine.model.config import ModelConfig
from engine.model.gguf import GGUFError, GGUFFile, open_gguf
from engine.model.loader import load_weights
from engine.model.prompt import (
    MAX_LETTERS,
    RENDER_VERSION,
    PromptEncoder,
    render_parts_for_state_text,
    render_state,
)
from engine.model.tokenizer import Tokenizer, TokenizerError
from engine.model.weights import Weights
from engine.quant.calibration import DEFAULT_ALPHA, QuantReport, is_int8, requantize
from engine.run.body import ForestBody
from engine.run.decoder import Decoder, DecodeSequence
from engine.run.executor import ForestCounters, ForestOutput, run_forest
from engine.run.forest import Forest, Segment, SegmentState, build_forest
from engine.run.reference import forward
from engine.run.tp import (
    Followers,
    TensorParallel,
    close_group,
    launch,
    rank_device,
    shard_weights,
    weights_digest,
)
from engine.types import INVALID_IMAGE, DecideRequest, DecideResult
from engine.vision.evidence import GridMemo, ImageSet, VisionTokens
from engine.vision.mmproj import VisionWeights, find_mmproj, load_mmproj
from engine.vision.placement import SegmentImages
from engine.vision.preprocess import ImageError, ImageLimits
from schemas.record import QuestionTrace, Readout, RoundReadout
from schemas.systemone import Question, SystemOneRequest
from schemas.systemone import decode_image as decode_image_b64

log = structlog.get_logger(__name__)

# The one-pass body (engine.run.body) is the CUDA int8 path: it passed the int8 invariance suite on
# an H200 (2026-12-01, f2bc914) and is 4.6-6.8x faster than the level executor on (a), (b), (d) at 27B.
# The level-by-level executor stays as the CPU/fp32/bf16 oracle (`body=False` still picks it on
# CUDA for tests that compare against it; it makes no batch-invariance promise there).
BODY_BY_DEFAULT = True
# The body's tensor-core settings on CUDA: chunk-64 GDN with bf16 operands (fp32 accumulation and
# state) and bf16 attention dots. Every setting is batch invariant (fixed configs, chunks and
# blocks aligned to segment starts); they differ from the exact fp32-dot body in rounding only.
# Measured 2026-12-01 on an H200 (ops/bench/RESULTS.md, "tensor-core body"): 27B (c) 639 ms vs
# 3,260 ms for the exact body, and at the 4B shape against the fp32 reference path they agree on
# 33 of 35 decisive read-outs (the exact int8 body: 34 of 35) with a smaller largest |delta p|
# (0.143 vs 0.189): the int8 quantization, not these dots, sets the distance to fp32. On CPU (the
# interpreter, tests) the body keeps its exact defaults.
CUDA_BODY_SETTINGS: dict[str, int | str] = {"gdn_chunk": 64, "gdn_dots": "bf16", "attention_dots": "bf16"}

Precision = Literal["fp32", "bf16", "int8"]
Mode = Literal["forest", "per_question"]
# Records name it; a replay under another version notes the change. 0.2.0: a CUDA read-out's
# coverage is summed on the device in fixed-order chunks (engine.kernels.vocab_mass), which
# moves its last bits; RoPE angles come from a per-position table (engine.run.rope). 0.3.0: CUDA int8
# runs the one-pass body by default, and the coverage sums are exact integer-limb sums; thought
# draws are keyed by content (seed, evidence digest, question tokens), not by event id and
# question key (engine.decide.sampling.thought_key): every thought, and so its second read-out, moves.
# 0.4.0: CUDA thoughts decode with the body's attention dots (bf16 on the CUDA default), and a
# top-k draw is plain float64 Python arithmetic (engine.decide.sampling._draw): CUDA thoughts move.
ENGINE_VERSION = "0.4.0"
# StartLux serves states up to 32k tokens; a request past this is rejected, not run for minutes.
MAX_REQUEST_TOKENS = 40_000
# An image is resized to at most this many pixels (2 MP: 2,048 image tokens with 16-pixel patches
# merged 2x2; a 1,024 x 768 screenshot keeps its size, 768 tokens). The model's own bound is 16 MP.
DEFAULT_MAX_IMAGE_PIXELS = 2_097_152


def uses_body(body: bool | None, precision: str, device: torch.device) -> bool:
    """Whether forests run in one pass (`engine.run.body`): `body` when given, else BODY_BY_DEFAULT on
    CUDA int8 - the serving path - and the level executor elsewhere (the CPU/fp32/bf16 oracle,
    which the interpreter-run body would only slow down). The body is int8-only: the float
    paths are references, and a float body would be a second implementation of them."""
    if body is None:
        body = BODY_BY_DEFAULT and precision == "int8" and device.type == "cuda"
    if body and precision != "int8":
        raise ValueError(f"the one-pass forest body runs the int8 path only, not {precision}")
    return body


def default_precision(device: str | torch.device) -> Precision:
    """int8 on CUDA (the batch-invariant serving path), fp32 elsewhere (the CPU oracle)."""
    return "int8" if torch.device(device).type == "cuda" else "fp32"


def file_digest(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_digest(path: Path, mmproj: Path | None = None) -> str:
    """The digest records name as their model: the GGUF file's sha256, or, when a vision projector
    is loaded beside it, a sha256 over both files' digests (decisions then depend on both)."""
    digest = file_digest(path)
    if mmproj is None:
        return digest
    return hashlib.sha256(f"{digest}+mmproj:{file_digest(mmproj)}".encode()).hexdigest()


def tokenizer_from_gguf(file: GGUFFile) -> Tokenizer:
    """The tokenizer the GGUF carries; a GGUFError naming the file when its metadata is unusable."""
    meta = file.metadata
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        if key not in meta:
            raise GGUFError(f"{file.path}: missing metadata key {key} (no tokenizer in this file)")
    try:
        return Tokenizer.from_gguf_metadata(
            meta["tokenizer.ggml.tokens"],
            meta.get("tokenizer.ggml.merges", []),
            meta["tokenizer.ggml.token_type"],
            meta.get("tokenizer.ggml.pre", "default"),
            model=meta.get("tokenizer.ggml.model", "gpt2"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        )
    except TokenizerError as e:
        raise GGUFError(f"{file.path}: unusable tokenizer metadata: {e}") from None


@dataclass
class _Question:
    """One question's progress through the stages of a decide call."""

    qid: str
    question: Question
    gate: float
    seed: int
    event_id: str
    state_text: str
    rounds: ChoiceRounds
    budget: int
    evidence_digest: str = ""  # the exact prefix this question hangs from (part of its thought key)
    first: Readout | None = None
    prompt_tokens: int = 0  # tokens of every read-out prompt, as if each ran on its own
    # AutoThink
    thinking: bool = False
    thought_ids: list[int] = field(default_factory=list)
    thought_truncated: bool = False
    thought_key: bytes | None = None  # memo of Engine._thought_key
    second: Readout | None = None
    token_memo: dict[tuple[tuple[int, ...], bool], list[int]] = field(default_factory=dict)
    source: DecideRequest | None = None  # its request: deadline and cancellation polled per step
    cut: str | None = None  # why a deadline or cancellation stopped its thought

    @property
    def option_ids(self) -> list[str]:
        if self.question.type == "noul":
            return ["yes", "no"]
        if self.question.type == "score":
            return [str(i) for i in range(len(self.question.criteria))]  # type: ignore[arg-type]
        return list(self.question.criteria)  # type: ignore[arg-type]


@dataclass(eq=False)
class _Thinking:
    """A thought in the device decoder: its sequence, last logits, and closing progress."""

    q: _Question
    seq: DecodeSequence
    logits: torch.Tensor | None
    closed: int | None = None  # closing tokens fed so far, once the thought has ended
    feed: int = 0  # the token this step feeds


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
        vision: VisionWeights | None = None,
        image_limits: ImageLimits | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        precision = default_precision(device) if precision is None else precision
        if precision not in ("fp32", "bf16", "int8"):
            raise ValueError(f"precision must be fp32, bf16 or int8, got {precision!r}")
        # int8: requantize once at startup (calibrate, smooth, quantize); see engine.quant.calibration.
        self.quant_report: QuantReport | None = None
        if precision == "int8" and not is_int8(weights):
            weights, self.quant_report = requantize(
                weights, PromptEncoder(tokenizer), alpha=smooth_alpha, device=device
            )
        # Tensor parallel: every rank requantized the same file the same way (checked), then
        # keeps its slice; decide() calls are broadcast from rank 0 (see engine.run.tp).
        self.tp = tp
        self.followers: Followers | None = None
        if tp is not None:
            if precision != "int8":
                raise ValueError(f"tensor parallelism runs the int8 path only, not {precision}")
            digest = weights_digest(weights)
            if tp.broadcast(digest) != digest:
                raise RuntimeError(f"rank {tp.rank} quantized the model differently from rank 0")
            weights = shard_weights(weights, tp)
            budget = default_budget(torch.device(device)) if cache_bytes is None else cache_bytes
            cache_bytes = tp.broadcast(budget)  # every rank must make the same cache decisions
        self.weights = weights
        self.config: ModelConfig = weights.config
        self.tokenizer = tokenizer
        self.decision_config = decision_config
        self.precision = precision
        self.model_name = model_name
        self.model_digest = model_digest
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.prompts = PromptEncoder(tokenizer)
        self.last_counters: list[ForestCounters] = []
        self.max_request_tokens = MAX_REQUEST_TOKENS
        self.cache = PrefixCache(default_budget(self.device) if cache_bytes is None else cache_bytes)
        # Whole forests in one pass on device tables (`engine.run.body`): `body` True/False chooses
        # (tests run it on CPU through Triton's interpreter); None: BODY_BY_DEFAULT on CUDA int8.
        body = uses_body(body, precision, self.device)
        # Under tensor parallelism the pass holds collectives: eager, same kernels, same bits.
        settings = CUDA_BODY_SETTINGS if self.device.type == "cuda" else {}
        graphs = False if tp is not None else None
        self.body = ForestBody(weights, graphs=graphs, **settings) if body else None
        # Images (engine.vision): the tower from the mmproj file, on this engine's device. Without
        # it, requests with images are rejected. An image is resized to at most max_image_pixels
        # (below the model's own bound when that is larger: it caps a request's image tokens).
        self.vision = vision.to(self.device) if vision is not None else None
        self.vision_tokens = VisionTokens.of(tokenizer) if vision is not None else None
        self.image_limits = image_limits or ImageLimits()
        self.max_image_pixels = (
            min(max_image_pixels, vision.config.max_pixels) if vision is not None else max_image_pixels
        )
        self._grids = GridMemo()
        t0 = time.perf_counter()
        root = build_forest([Segment(tuple(self.prompts.prefix_ids), None)])
        self.root: SegmentState = self._run_forest(root).states[0]
        log.info("system_segment_ready", tokens=self.root.length, seconds=round(time.perf_counter() - t0, 3))

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
    ) -> Engine:
        """precision None: int8 on CUDA, fp32 elsewhere. smooth_alpha: SmoothQuant strength (int8 only).
        body: run forests in one pass (`engine.run.body`); None: `BODY_BY_DEFAULT` for int8 on CUDA.
        mmproj: the vision projector GGUF (images in evidence); None finds one next to the model
        by llama.cpp's naming (`mmproj-*.gguf`, `engine.vision.mmproj.find_mmproj`); False: none.

        tp > 1 runs the model over `tp` devices (cuda -> cuda:0..tp-1; cpu -> gloo processes):
        this process is rank 0 and starts the others, which serve its `decide` calls until
        `close()`. Results are bit-identical to tp=1 (int8 only).
        """
        followers = None
        if isinstance(tp, int):
            if tp < 1:
                raise ValueError(f"tp must be >= 1, got {tp}")
            if tp > 1:
                threads = torch.get_num_threads()
                args = (
                    str(path),
                    precision,
                    decision_config,
                    cache_bytes,
                    smooth_alpha,
                    threads,
                    body,
                    mmproj,
                )
                group, followers = launch(tp, device, _follower_main, args)
                device, tp = str(rank_device(device, 0)), group
            else:
                tp = None  # type: ignore[assignment]
        try:
            engine = cls._load(
                path, device, precision, decision_config, cache_bytes, smooth_alpha, tp, body, mmproj
            )
        except BaseException:
            if followers is not None:
                followers.join(timeout=5.0)
                close_group()
            raise
        engine.followers = followers
        return engine

    @classmethod
    def _load(
        cls,
        path: str | Path,
        device: str,
        precision: Precision | None,
        decision_config: str | Path | DecisionConfig | None,
        cache_bytes: int | None,
        smooth_alpha: float,
        tp: TensorParallel | None,
        body: bool | None = None,
        mmproj: str | Path | bool | None = None,
    ) -> Engine:
        path = Path(path)
        precision = default_precision(device) if precision is None else precision
        t0 = time.perf_counter()
        file = open_gguf(path)
        file.config()  # architecture and hyper-parameters first: a clear error for a foreign file
        tokenizer = tokenizer_from_gguf(file)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        weights = load_weights(file, dtype=dtype)
        if isinstance(decision_config, DecisionConfig):
            dc = decision_config
        else:
            dc = load_decision_config(decision_config if decision_config is not None else path)
        name = str(file.metadata.get("general.name") or path.stem)
        mmproj_path = find_mmproj(path) if mmproj is None or mmproj is True else mmproj or None
        if mmproj is True and mmproj_path is None:
            raise FileNotFoundError(f"no mmproj-*.gguf next to {path}: pass its path")
        vision = load_mmproj(mmproj_path) if mmproj_path is not None else None
        if vision is not None and vision.config.out_hidden_size != weights.config.hidden_size:
            why = (
                f"{mmproj_path}: projects to {vision.config.out_hidden_size} dims, "
                f"the model {path.name} has {weights.config.hidden_size}: not its projector"
            )
            if mmproj is not None:  # named by the caller: an error
                raise GGUFError(why)
            log.warning("mmproj_skipped", reason=why)  # found beside it: another model's projector
            vision = None
        digest = model_digest(path, Path(mmproj_path) if vision is not None else None)
        engine = cls(
            weights=weights,
            tokenizer=tokenizer,
            decision_config=dc,
            precision=precision,
            model_name=name,
            model_digest=digest,
            device=device,
            cache_bytes=cache_bytes,
            smooth_alpha=smooth_alpha,
            tp=tp,
            body=body,
            vision=vision,
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
        state_text = render_state(request.state)
        total = len(self.prompts.evidence_ids(state_text))
        if request.images and self.vision is not None:
            # checks every image (an ImageError, a ValueError, names the bad one): the pipeline and
            # the server call this before batching, so a hostile image never reaches a batch
            total += len(self._image_set(request).tokens(self.vision_tokens))  # type: ignore[arg-type]
        for question in request.questions.values():
            parts = render_parts_for_state_text(state_text, question, _first_group(question))
            total += len(self.prompts.question_ids(parts.question_text))
        return total

    def read_with_thought(self, request: SystemOneRequest, qid: str, thought_ids: list[int]) -> Readout:
        """The letters read after a given thought: question `qid` of `request` with `<think>\n`,
        `thought_ids`, then `</think>\n\n` (the closing `decide` feeds after a thought).

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
        vocab = self.config.vocab_size
        segments: list[Segment] = []
        evidence_index: dict[tuple[int, ...], int] = {}
        read_index: list[int] = []
        questions: list[Question] = []
        for request, qid, thought_ids in reads:
            question = request.questions.get(qid)
            if question is None:
                raise ValueError(f"request has no question {qid!r}")
            n = _n_options(question)
            if n > MAX_LETTERS:
                raise ValueError(
                    f"question {qid!r} has {n} options: a thought is read only with <= {MAX_LETTERS}"
                )
            if any(not 0 <= int(t) < vocab for t in thought_ids):
                raise ValueError(f"thought token ids must be in 0..{vocab - 1}")
            state_text = render_state(request.state)
            parts = render_parts_for_state_text(state_text, question)
            tokens = self.prompts.question_ids(parts.question_text, think=True)
            tokens += [int(t) for t in thought_ids] + list(self.prompts.think_close_ids)
            key = tuple(self.prompts.evidence_ids(state_text))
            if key not in evidence_index:
                evidence_index[key] = len(segments)
                segments.append(Segment(key, self.root))
            read_index.append(len(segments))
            segments.append(Segment(tuple(tokens), evidence_index[key], read=True))
            questions.append(question)
        if not reads:
            return []
        out, packed, rows = self._run(segments)
        dc = self.decision_config
        result: list[Readout] = []
        for question, i in zip(questions, read_index, strict=True):
            n = _n_options(question)
            ro = read_letters(
                out.logits[rows[packed[i]]],
                self.prompts.letter_token_ids(n),
                dc.temperature(question.type),
                coverage=dc.coverage,
            )
            rounds = ChoiceRounds(n)
            rounds.submit([ro])
            if question.type == "choice":
                options = list(question.criteria)  # type: ignore[arg-type]
            else:
                options = ["yes", "no"] if question.type == "noul" else [str(i) for i in range(n)]
            coverage = _unit(ro.coverage if ro.coverage is not None else 1.0)
            letters_shown = [chr(ord("A") + k) for k in range(n)]
            result.append(
                Readout(
                    options=options,
                    probabilities=rounds.probabilities,
                    coverage=coverage,
                    temperature=dc.temperature(question.type),
                    rounds=[
                        RoundReadout(
                            options=options, letters=letters_shown, logits=list(ro.logits), coverage=coverage
                        )
                    ],
                )
            )
        return result

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
            self.followers.send(("decide", requests, mode, self._knobs()))
        if between_steps is not None and self.tp is not None:
            raise ValueError("between_steps cannot interleave work under tensor parallelism")
        outer_step = getattr(self, "_between_steps", None)
        self._on_ready = on_ready
        self._between_steps = between_steps if between_steps is not None else outer_step
        try:
            return self._decide(requests, mode)
        finally:
            self._on_ready = None
            self._between_steps = outer_step

    def _knobs(self) -> dict[str, Any]:
        """Settings callers may change on rank 0 that steer the computation: followers mirror them."""
        return {
            "decision_config": self.decision_config,
            "max_request_tokens": self.max_request_tokens,
            "use_decoder": getattr(self, "use_decoder", None),
        }

    def follow(self, pipe: Connection) -> None:
        """A follower rank's loop: run every decide call rank 0 sends, until it closes the pipe."""
        while True:
            try:
                message = pipe.recv()
            except EOFError:
                return
            if message is None:
                return
            _, requests, mode, knobs = message
            for name, value in knobs.items():
                setattr(self, name, value)
            try:
                self._decide(requests, mode)
            except Exception as e:  # rank 0 runs the same code on the same input: it raises too
                log.warning("tp_follower_decide_failed", rank=self.tp and self.tp.rank, error=repr(e))

    def close(self) -> None:
        """Stop the follower ranks and leave the process group (no-op without tensor parallelism)."""
        if self.tp is not None and self.followers is not None:
            self.followers.join()
            self.followers = None
            close_group()

    def _decide(self, requests: list[DecideRequest], mode: Mode) -> list[DecideResult]:
        t0 = time.perf_counter()
        self.last_counters = []
        dc = self.decision_config
        rejected = {
            r: reason for r, req in enumerate(requests) if (reason := self._unsupported(req)) is not None
        }
        images: dict[int, ImageSet] = {}
        for r, req in enumerate(requests):
            if r not in rejected and req.request.images:
                try:
                    images[r] = self._image_set(req.request)
                except ImageError as e:
                    rejected[r] = f"{INVALID_IMAGE}: {e}"
        stopped = self._stopped_before_start(requests, rejected)
        live = [r for r in range(len(requests)) if r not in rejected and r not in stopped]
        batch: list[list[_Question]] = []
        state_texts: list[str] = []
        for r in live:
            req = requests[r]
            state_text = render_state(req.request.state)
            state_texts.append(state_text)
            event_gate = dc.gate if req.gate is None else req.gate
            # A request (an event) may lower the budget, never raise it past the operator's ceiling:
            # the request's own, else the decision config's (so Kafka records stay a function of
            # the config their digest names).
            budget = dc.thought_budget if req.thought_budget is None else req.thought_budget
            ceiling = dc.thought_budget if req.max_thought_budget is None else req.max_thought_budget
            budget = min(budget, ceiling)
            qs = []
            for qid, question in req.request.questions.items():
                gate = event_gate if question.gate is None else question.gate
                if req.max_gate is not None:
                    gate = min(gate, req.max_gate)
                qs.append(
                    _Question(
                        qid=qid,
                        question=question,
                        gate=gate,
                        seed=req.seed,
                        event_id=req.request_id,
                        state_text=state_text,
                        rounds=ChoiceRounds(_n_options(question)),
                        budget=budget,
                        source=req,
                    )
                )
            batch.append(qs)
        evidence_images = [images.get(r) for r in live]
        evidence_ids = [
            (im.tokens(self.vision_tokens) if im is not None else []) + self.prompts.evidence_ids(s)  # type: ignore[arg-type]
            for s, im in zip(state_texts, evidence_images, strict=True)
        ]
        # The token limit, on the tokens the first stage will really run (tokenized once, reused).
        for i in reversed(range(len(live))):
            needed = len(self.prompts.prefix_ids) + len(evidence_ids[i])
            reads = [(q, g) for q in batch[i] for g in q.rounds.pending()]
            needed += sum(len(self._question_tokens(q, g, False)) for q, g in reads)
            if needed > self.max_request_tokens:
                limit = self.max_request_tokens
                rejected[live[i]] = f"request needs {needed} tokens, more than this engine's limit of {limit}"
                del live[i], batch[i], evidence_ids[i], evidence_images[i]
        # Exact-prefix cache: a hit starts the questions from the kept evidence state. Keys
        # are pinned for the whole call, so nothing this batch reads is evicted under it.
        keys = [
            prefix_key(self.prompts.prefix_ids + ids, im.digests if im is not None else ())
            for ids, im in zip(evidence_ids, evidence_images, strict=True)
        ]
        for qs, key in zip(batch, keys, strict=True):
            for q in qs:
                q.evidence_digest = key
        evidence_states: list[SegmentState | None] = [None] * len(live)
        if mode == "forest":
            for i, key in enumerate(keys):
                evidence_states[i] = self.cache.get(key)
                self.cache.pin(key)
        early: dict[int, DecideResult] = {}
        on_ready = getattr(self, "_on_ready", None)
        # This call's own hook (None without on_ready): a nested call (between thought steps) must
        # never hand its results to the outer call's on_ready.
        outer_hook = getattr(self, "_ready_hook", None)
        self._ready_hook: Callable[[int, list[_Question]], None] | None = None
        if on_ready is not None:

            def ready(i: int, qs: list[_Question]) -> None:
                early[live[i]] = self._result(requests[live[i]], qs, time.perf_counter() - t0)
                on_ready(live[i], early[live[i]])

            self._ready_hook = ready
        try:
            self._decide_stages(batch, evidence_ids, evidence_states, mode, evidence_images)
            if mode == "forest":
                for key, state in zip(keys, evidence_states, strict=True):
                    if state is not None:
                        self.cache.put(key, state)
        finally:
            self._ready_hook = outer_hook
            if mode == "forest":
                for key in keys:
                    self.cache.unpin(key)

        elapsed = time.perf_counter() - t0
        by_request = dict(zip(live, batch, strict=True))
        return [
            _rejected_result(req, rejected[r])
            if r in rejected
            else _stopped_result(req, stopped[r])
            if r in stopped
            else early[r]
            if r in early
            else self._result(req, by_request[r], elapsed)
            for r, req in enumerate(requests)
        ]

    def _stopped_before_start(
        self, requests: list[DecideRequest], rejected: dict[int, str]
    ) -> dict[int, str]:
        """Requests already past their deadline or cancelled when the call starts (they waited in a
        queue): they run nothing. Rank 0 decides under tensor parallelism, as in `_keep_going`."""
        if not any((req.deadline, req.cancel) != (None, None) for req in requests):
            return {}
        reasons = [req.stop_reason() for req in requests]
        if self.tp is not None:
            reasons = self.tp.broadcast(reasons)
        return {r: why for r, why in enumerate(reasons) if why is not None and r not in rejected}

    def _unsupported(self, req: DecideRequest) -> str | None:
        """Why this engine cannot answer `req`, or None. Rejected requests get an error result."""
        if req.request.images and self.vision is None:
            return "images need the vision projector: load the model with its mmproj GGUF"
        return None

    def _image_set(self, request: SystemOneRequest) -> ImageSet:
        """The request's images checked (ImageError on the first unusable one) with their grids."""
        assert self.vision is not None
        datas = []
        for i, s in enumerate(request.images or []):
            try:
                datas.append(decode_image_b64(s))
            except ValueError as e:
                raise ImageError(f"image {i}: {e}") from None
        return ImageSet.check(datas, self.vision, self.image_limits, self.max_image_pixels, self._grids)

    def _decide_stages(
        self,
        batch: list[list[_Question]],
        evidence_ids: list[list[int]],
        evidence_states: list[SegmentState | None],
        mode: Mode,
        evidence_images: list[ImageSet | None],
    ) -> None:
        # Stage loop 1: first read-outs (rounds for >26 options).
        while True:
            reads = [(r, q, group) for r, qs in enumerate(batch) for q in qs for group in q.rounds.pending()]
            if not reads:
                break
            outs = self._read_stage(reads, evidence_ids, evidence_states, mode, evidence_images, think=False)
            per_question: dict[int, list[LetterReadout]] = {}
            for (_, q, group), (logits, _) in zip(reads, outs, strict=True):
                per_question.setdefault(id(q), []).append(self._read_letters(q, logits, len(group)))
            for _, q in _unique_questions(reads):
                q.rounds.submit(per_question[id(q)])
        for qs in batch:
            for q in qs:
                q.first = self._readout(q, q.rounds)

        # AutoThink: questions whose top first probability is below their gate.
        thinkers = [(r, q) for r, qs in enumerate(batch) for q in qs if _should_think(q)]
        hook = getattr(self, "_ready_hook", None)
        if hook is not None:  # requests that will not think are final now
            thinking = {r for r, _ in thinkers}
            for r, qs in enumerate(batch):
                if r not in thinking:
                    hook(r, qs)
        if thinkers:
            self._think(thinkers, evidence_ids, evidence_states, mode, evidence_images)

    # ------------------------------------------------------------------------------ stages
    def _question_tokens(self, q: _Question, group: list[int], think: bool) -> list[int]:
        """A read's question-segment tokens, rendered and tokenized once per decide call."""
        key = (tuple(group), think)
        if key not in q.token_memo:
            option_ids = [q.option_ids[i] for i in group] if q.question.type == "choice" else None
            parts = render_parts_for_state_text(q.state_text, q.question, option_ids)
            q.token_memo[key] = self.prompts.question_ids(parts.question_text, think=think)
        return q.token_memo[key]

    def _thought_key(self, q: _Question) -> bytes:
        """The counter key of `q`'s thought: the record seed, the evidence digest and the tokens of
        the think prompt (all options, `<think>\\n` at the end). The question's key and the event
        id are not in it: the same question about the same evidence under the same seed thinks the
        same thought, whatever it is called and however often it is asked."""
        if q.thought_key is None:
            tokens = self._question_tokens(q, list(range(len(q.option_ids))), True)
            q.thought_key = thought_key(q.seed, q.evidence_digest, tokens)
        return q.thought_key

    def _run_forest(self, forest: Forest) -> ForestOutput:
        if self.body is not None:
            return self.body.run(forest)
        return run_forest(self.weights, forest, dtype=self.dtype)

    def _run(self, segments: list[Segment]) -> tuple[ForestOutput, dict[int, int], dict[int, int]]:
        """Run a forest; also return caller index -> packed index, and packed index -> logits row."""
        forest = build_forest(segments)
        out = self._run_forest(forest)
        self.last_counters.append(out.counters)
        rows = {seg: row for row, seg in enumerate(forest.read_segments)}
        return out, forest.packed_index, rows

    def _read_stage(
        self,
        reads: list[tuple[int, _Question, list[int]]],
        evidence_ids: list[list[int]],
        evidence_states: list[SegmentState | None],
        mode: Mode,
        evidence_images: list[ImageSet | None],
        *,
        think: bool,
    ) -> list[tuple[torch.Tensor, SegmentState]]:
        """One forest for `reads`: (next-token logits, state after the prompt) per read.

        Evidence runs once per request, in the first stage; later stages start from the kept
        evidence states.
        """
        if self.body is not None and mode == "forest":
            self._pre_run_images(reads, evidence_ids, evidence_states, evidence_images)
        segments: list[Segment] = []
        evidence_index: dict[tuple[tuple[int, ...], tuple[str, ...] | None], int] = {}
        read_index: list[int] = []
        for r, q, group in reads:
            q_tokens = self._question_tokens(q, group, think)
            if not think:
                q.prompt_tokens += len(self.prompts.prefix_ids) + len(evidence_ids[r]) + len(q_tokens)
            im = evidence_images[r]
            if mode == "per_question":
                read_index.append(len(segments))
                whole = self.prompts.prefix_ids + evidence_ids[r] + q_tokens
                segments.append(Segment(tuple(whole), None, True, self._segment_images(whole, im)))
                continue
            parent: int | SegmentState
            kept = evidence_states[r]
            if kept is not None:
                parent = kept
            else:
                # identical evidence within one batch runs once: key on the tokens and images
                key = tuple(evidence_ids[r])
                if (key, im and im.digests) not in evidence_index:
                    evidence_index[(key, im and im.digests)] = len(segments)
                    segments.append(Segment(key, self.root, images=self._segment_images(key, im)))
                parent = evidence_index[(key, im and im.digests)]
            read_index.append(len(segments))
            segments.append(Segment(tuple(q_tokens), parent, read=True))
        out, packed, rows = self._run(segments)
        for r, ids in enumerate(evidence_ids):
            im = evidence_images[r]
            idx = evidence_index.get((tuple(ids), im and im.digests))
            if idx is not None and evidence_states[r] is None:
                evidence_states[r] = out.states[packed[idx]]
        return [(out.logits[rows[packed[i]]], out.states[packed[i]]) for i in read_index]

    def _segment_images(self, tokens: Sequence[int], images: ImageSet | None) -> SegmentImages | None:
        """The tower's embeddings and the rope positions of a segment holding `images` (or None)."""
        if images is None:
            return None
        assert self.vision is not None and self.vision_tokens is not None
        return images.segment(
            tokens, self.vision_tokens, self.vision, self.image_limits, self.max_image_pixels
        )

    def _pre_run_images(
        self,
        reads: list[tuple[int, _Question, list[int]]],
        evidence_ids: list[list[int]],
        evidence_states: list[SegmentState | None],
        evidence_images: list[ImageSet | None],
    ) -> None:
        """Evidence holding images, when forests run in one pass: its state first, through the level
        executor (the body's device tables have no image rows), so the questions hang from it as
        from a cached state. Each such evidence runs as a forest of its own: its shapes, and so its
        bits, are those it has alone whatever the batch (on CUDA too, where the executor's level-wide
        ops promise nothing across batch shapes)."""
        todo: dict[tuple[tuple[int, ...], tuple[str, ...]], list[int]] = {}
        for r, _, _ in reads:
            im = evidence_images[r]
            if im is not None and evidence_states[r] is None:
                todo.setdefault((tuple(evidence_ids[r]), im.digests), []).append(r)
        for (tokens, _), rs in todo.items():
            segment = Segment(tokens, self.root, images=self._segment_images(tokens, evidence_images[rs[0]]))
            out = run_forest(self.weights, build_forest([segment]), dtype=self.dtype)
            self.last_counters.append(out.counters)
            for r in rs:
                evidence_states[r] = out.states[0]

    def _read_letters(self, q: _Question, logits: torch.Tensor, n: int) -> LetterReadout:
        dc = self.decision_config
        return read_letters(
            logits, self.prompts.letter_token_ids(n), dc.temperature(q.question.type), coverage=dc.coverage
        )

    def _readout(self, q: _Question, rounds: ChoiceRounds) -> Readout:
        letters_all = [chr(ord("A") + i) for i in range(26)]
        round_records = []
        for stage in rounds.stages:
            for group, ro in zip(stage.groups, stage.readouts, strict=True):
                round_records.append(
                    RoundReadout(
                        options=[q.option_ids[i] for i in group],
                        letters=letters_all[: len(group)],
                        logits=list(ro.logits),
                        coverage=_unit(ro.coverage if ro.coverage is not None else 1.0),
                    )
                )
        final = rounds.stages[-1].readouts[0]
        return Readout(
            options=q.option_ids,
            probabilities=rounds.probabilities,
            coverage=_unit(final.coverage if final.coverage is not None else 1.0),
            temperature=self.decision_config.temperature(q.question.type),
            rounds=round_records,
        )

    def _think(
        self,
        thinkers: list[tuple[int, _Question]],
        evidence_ids: list[list[int]],
        evidence_states: list[SegmentState | None],
        mode: Mode,
        evidence_images: list[ImageSet | None],
    ) -> None:
        """Seeded thought decoding for every thinking question at once, then the second read-out.

        The thought starts from a read of the question with `<think>\\n`; every draw is keyed
        by what the model sees (seed, evidence digest, the question's think-prompt tokens) and
        the step, never by the question's key (see `_thought_key`). At the budget, or when
        `</think>` is drawn, the closing tokens are fed and the letters read after them. On
        CUDA int8 the steps run in `engine.run.decoder` (graph-captured; eager under tensor
        parallelism); elsewhere each step is a forest of one-token segments, one per active
        question, hanging from its own question's state.
        """
        if getattr(self, "_in_step_hook", False):  # the outer call's thought state is live
            raise RuntimeError("a decide run between thought steps must not think (gate 0)")
        keep = self._keep_going([q for _, q in thinkers])
        thinkers = [t for t, go in zip(thinkers, keep, strict=True) if go]
        if not thinkers:
            return
        reads = [(r, q, list(range(len(q.option_ids)))) for r, q in thinkers]
        outs = self._read_stage(reads, evidence_ids, evidence_states, mode, evidence_images, think=True)
        started: list[tuple[_Question, torch.Tensor, SegmentState]] = []
        for (_, q, _), (logits, state) in zip(reads, outs, strict=True):
            q.thinking = True
            started.append((q, logits, state))
        if self._decodes_on_device():
            self._think_decoder(started)
        else:
            self._think_forest(started)

    def _decodes_on_device(self) -> bool:
        """Whether thoughts go through `engine.run.decoder`: int8 on CUDA (with or without tensor
        parallelism: the decoder gathers whole rows where one device would quantize them).

        `use_decoder` (True/False) overrides the choice; tests use it to run the decoder on CPU.
        """
        forced = getattr(self, "use_decoder", None)
        if forced is not None:
            return bool(forced)
        return self.precision == "int8" and self.device.type == "cuda"

    def _second_readout(self, q: _Question, logits: torch.Tensor) -> None:
        second = ChoiceRounds(len(q.option_ids))
        second.submit([self._read_letters(q, logits, len(q.option_ids))])
        q.second = self._readout(q, second)

    def _keep_going(self, qs: list[_Question]) -> list[bool]:
        """Per question: False when its request is past its deadline or cancelled (and mark it cut).

        Polled before each thought step. A cut thought just leaves the step: the others' segments
        or decoder rows are computed alone whatever their companions (the int8 contract), so their
        bits do not change. Under tensor parallelism rank 0 decides and broadcasts, since every
        rank must run the same steps (followers get unset cancel tokens); the broadcast only
        happens when some request can stop at all, which every rank knows alike.
        """
        if not any(q.source is not None and (q.source.deadline, q.source.cancel) != (None, None) for q in qs):
            return [True] * len(qs)
        reasons = [q.source.stop_reason() if q.source is not None else None for q in qs]
        if self.tp is not None:
            reasons = self.tp.broadcast(reasons)
        for q, reason in zip(qs, reasons, strict=True):
            if reason is not None:
                q.cut = reason
        return [reason is None for reason in reasons]

    def _step_hook(self) -> None:
        """The caller's `between_steps`, once per thought step; a nested `decide` inside it gets no
        hook of its own (it never thinks), and the outer call's counters are kept."""
        hook = getattr(self, "_between_steps", None)
        if hook is None:
            return
        counters = self.last_counters
        self._between_steps = None
        self._in_step_hook = True
        try:
            hook()
        finally:
            self._in_step_hook = False
            self._between_steps = hook
            self.last_counters = counters

    def _think_forest(self, active: list[tuple[_Question, torch.Tensor, SegmentState]]) -> None:
        dc = self.decision_config
        end_think = self.tokenizer.special.end_think
        closing = tuple(self.prompts.think_close_ids)
        while active:
            self._step_hook()
            keep = self._keep_going([q for q, _, _ in active])
            active = [a for a, go in zip(active, keep, strict=True) if go]
            if not active:
                return
            feeds: list[tuple[_Question, tuple[int, ...], bool, SegmentState]] = []
            for q, logits, state in active:
                if len(q.thought_ids) >= q.budget:
                    q.thought_truncated = True
                    feeds.append((q, closing, True, state))
                    continue
                u = uniform(self._thought_key(q), len(q.thought_ids))
                # the batched sampler on one row: sample_token's token, without sorting the vocabulary
                (token,) = sample_tokens(
                    logits[None],
                    [u],
                    temperature=dc.thought_temperature,
                    top_p=dc.thought_top_p,
                    top_k=dc.thought_top_k,
                )
                if token == end_think:
                    feeds.append((q, closing, True, state))
                else:
                    q.thought_ids.append(token)
                    feeds.append((q, (token,), False, state))
            segments = [Segment(tokens, state, read=True) for _, tokens, _, state in feeds]
            out, packed, rows = self._run(segments)
            active = []
            for i, (q, _, is_closing, _) in enumerate(feeds):
                logits = out.logits[rows[packed[i]]]
                if is_closing:
                    self._second_readout(q, logits)
                else:
                    active.append((q, logits, _fold_into_parent(out.states[packed[i]])))

    def _thought_decoder(self) -> Decoder:
        decoder = getattr(self, "_decoder", None)
        if decoder is None:
            # Under tensor parallelism the step holds collectives: run it eagerly (same kernels,
            # same bits as the graph) rather than capture NCCL calls in a CUDA graph.
            decoder = Decoder(
                self.weights,
                graphs=False if self.tp is not None else None,
                attention_dots=self.body.attention_dots if self.body is not None else "ieee",
            )
            self._decoder = decoder
        return decoder

    def _think_decoder(self, started: list[tuple[_Question, torch.Tensor, SegmentState]]) -> None:
        """The same thought loop as `_think_forest`, one token per step for every live thought.

        Closing tokens go in one per step too; the letters are read after the last. At most
        `Decoder.max_live` thoughts are live at a time (the largest bucket, or fewer when their
        buffers would not fit); the others wait with their first logits. Which thoughts share
        a step never changes a thought's bits.
        """
        decoder = self._thought_decoder()
        try:
            self._decode_thoughts(decoder, started)
        finally:
            decoder.forget()  # finished thoughts' states and buffers go back to the allocator

    def _decode_thoughts(
        self, decoder: Decoder, started: list[tuple[_Question, torch.Tensor, SegmentState]]
    ) -> None:
        dc = self.decision_config
        end_think = self.tokenizer.special.end_think
        closing = list(self.prompts.think_close_ids)
        waiting = started[::-1]  # pop() admits in the callers' order
        limit = decoder.max_live(max(q.budget for q, _, _ in started) + len(closing))
        live: list[_Thinking] = []
        while live or waiting:
            self._step_hook()
            keep = self._keep_going([t.q for t in live] + [q for q, _, _ in waiting])
            n_live = len(live)
            live = [t for t, go in zip(live, keep[:n_live], strict=True) if go]
            waiting = [w for w, go in zip(waiting, keep[n_live:], strict=True) if go]
            if not live and not waiting:
                return
            while waiting and len(live) < limit:
                q, logits, state = waiting.pop()
                live.append(_Thinking(q, decoder.start(state, q.budget + len(closing)), logits))
            # draw for every live thought that is still thinking and under its budget
            drawing = []
            for t in live:
                if t.closed is None and len(t.q.thought_ids) >= t.q.budget:
                    t.q.thought_truncated = True
                    t.closed = 0
                elif t.closed is None:
                    drawing.append(t)
            if drawing:
                us = [uniform(self._thought_key(t.q), len(t.q.thought_ids)) for t in drawing]
                assert all(t.logits is not None for t in drawing)
                tokens = sample_tokens(
                    torch.stack([t.logits for t in drawing]),  # type: ignore[misc]
                    us,
                    temperature=dc.thought_temperature,
                    top_p=dc.thought_top_p,
                    top_k=dc.thought_top_k,
                )
                for t, token in zip(drawing, tokens, strict=True):
                    if token == end_think:
                        t.closed = 0
                    else:
                        t.q.thought_ids.append(token)
                        t.feed = token
            for t in live:
                if t.closed is not None:
                    t.feed = closing[t.closed]
            logits = decoder.step([t.seq for t in live], [t.feed for t in live])
            still: list[_Thinking] = []
            for row, t in enumerate(live):
                if t.closed is None:
                    t.logits = logits[row]
                    still.append(t)
                    continue
                t.closed += 1
                if t.closed == len(closing):
                    self._second_readout(t.q, logits[row])
                else:
                    still.append(t)
            live = still

    def _result(self, req: DecideRequest, qs: list[_Question], elapsed: float) -> DecideResult:
        answers: dict[str, Any] = {}
        traces: dict[str, QuestionTrace] = {}
        input_tokens = 0
        output_tokens = 0
        stopped = next((q.cut for q in qs if q.cut is not None), None)
        for q in qs:
            assert q.first is not None
            final = list(q.first.probabilities)
            if q.second is not None:
                final = list(
                    mix_probabilities(
                        q.first.probabilities, q.second.probabilities, self.decision_config.second_weight
                    )
                )
            answers[q.qid] = answer_for(q.question, final, confidence=self.decision_config.confidence)
            input_tokens += q.prompt_tokens
            output_tokens += len(q.thought_ids)
            traces[q.qid] = QuestionTrace(
                prompt_tokens=q.prompt_tokens,
                first=q.first,
                second=q.second,
                thought=self.tokenizer.decode(q.thought_ids) if q.thinking else None,
                thought_tokens=len(q.thought_ids),
                thought_truncated=q.thought_truncated,
                final_probabilities=final,
            )
        return DecideResult(
            request_id=req.request_id,
            answers=answers,
            traces=traces,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            timings={"decide_s": elapsed},
            stopped=stopped,  # type: ignore[arg-type]
            thought_ids={q.qid: list(q.thought_ids) for q in qs if q.thinking},
        )


def _should_think(q: _Question) -> bool:
    """The AutoThink gate: think when the first read-out's top probability is below the gate.

    The boundary is inclusive for the answer: top == gate stands. Gate 0 never thinks, gate 1
    always does. Choice questions answered in rounds (more than 26 options) do not think: their
    second read-out would need the rounds again.
    """
    assert q.first is not None
    if q.gate <= 0.0 or len(q.option_ids) > MAX_LETTERS:
        return False
    return q.gate >= 1.0 or max(q.first.probabilities) < q.gate


def _stopped_result(req: DecideRequest, reason: str) -> DecideResult:
    return DecideResult(req.request_id, {}, {}, 0, 0, stopped=reason)  # type: ignore[arg-type]


def _rejected_result(req: DecideRequest, reason: str) -> DecideResult:
    return DecideResult(
        request_id=req.request_id, answers={}, traces={}, input_tokens=0, output_tokens=0, error=reason
    )


def _n_options(question: Question) -> int:
    if question.type == "noul":
        return 2
    return len(question.criteria)  # type: ignore[arg-type]


def _first_group(question: Question) -> list[str] | None:
    if question.type != "choice":
        return None
    ids = list(question.criteria)  # type: ignore[arg-type]
    return ids[: min(len(ids), 25)] if len(ids) > 26 else None


def _unit(x: float) -> float:
    return min(1.0, max(0.0, float(x)))


def _unique_questions(reads: list[tuple[int, _Question, list[int]]]) -> list[tuple[int, _Question]]:
    seen: dict[int, tuple[int, _Question]] = {}
    for r, q, _ in reads:
        seen.setdefault(id(q), (r, q))
    return list(seen.values())


def _fold_into_parent(state: SegmentState) -> SegmentState:
    """Fold a one-token thought segment into its parent, the question's own think segment.

    That parent belongs to this question alone (a thought has no siblings), so folding keeps
    the chain at [root, evidence, question + thought] however long the thought gets, and the
    attention pieces a question reduces never depend on other questions.
    """
    parent = state.parent
    assert parent is not None
    merged = SegmentState(
        parent=parent.parent,
        start=parent.start,
        length=parent.length + state.length,
        shift=parent.shift + state.shift,  # a one-segment prompt holding images: its positions run short
    )
    merged.recurrent, merged.conv = state.recurrent, state.conv
    for i in state.keys:
        merged.keys[i] = torch.cat([parent.keys[i], state.keys[i]], dim=1)
        merged.values[i] = torch.cat([parent.values[i], state.values[i]], dim=1)
    return merged


def _follower_main(
    rank: int,
    world: int,
    device: str,
    port: int,
    pipe: Connection,
    path: str,
    precision: Precision | None,
    decision_config: str | Path | DecisionConfig | None,
    cache_bytes: int | None,
    smooth_alpha: float,
    threads: int,
    body: bool | None,
    mmproj: str | Path | bool | None = None,
) -> None:
    """Entry point of tensor-parallel ranks 1..N-1 (a spawned process)."""
    from engine.run.tp import init_group

    torch.set_num_threads(threads)
    dev = rank_device(device, rank)
    tp = init_group(rank, world, dev, port)
    try:
        engine = Engine._load(
            path, str(dev), precision, decision_config, cache_bytes, smooth_alpha, tp, body, mmproj
        )
        engine.follow(pipe)
    finally:
        close_group()
