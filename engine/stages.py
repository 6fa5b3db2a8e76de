"""The stages of a `decide` call, over the engine's runner, prompts and prefix cache.

Each stage is one packed forest: the evidence segments of the requests that still have reads
pending (first stage only: later stages reuse the evidence states kept from the first), and one
question segment per pending read. Stages exist for choice questions with more than 26 options
(rounds) and for AutoThink (thought decoding, `engine.thoughts`, and the second read-out). The
system segment runs once, when the engine loads (`Stages.root`).

`mode="per_question"` renders every read as its own full prompt with no sharing at all: the
oracle the forest is tested against.

May import: `engine.run`, `engine.model`, `engine.decide`, `engine.vision`, `engine.cache`,
`engine.questions`, `engine.thoughts`, `engine.types` (not the facade).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from engine.cache import PrefixCache, prefix_key
from engine.decide.decision_config import DecisionConfig
from engine.decide.readout import ChoiceRounds, LetterReadout, read_letters, read_letters_many
from engine.decide.sampling import thought_key
from engine.model.prompt import MAX_LETTERS, PromptEncoder, render_parts_for_state_text, render_state
from engine.model.tokenizer import Tokenizer
from engine.questions import (
    QuestionRun,
    n_options,
    option_ids,
    readout_record,
    rejected_result,
    result,
    should_think,
    single_readout,
    stopped_result,
)
from engine.run.executor import ForestCounters, ForestOutput
from engine.run.forest import Segment, SegmentState, build_forest
from engine.run.runner import Runner
from engine.run.tp import TensorParallel
from engine.thoughts import DecoderSteps, ForestSteps, Steps, ThoughtRules, think
from engine.types import INVALID_IMAGE, DecideRequest, DecideResult
from engine.vision.evidence import GridMemo, ImageSet, VisionTokens
from engine.vision.mmproj import VisionWeights
from engine.vision.placement import SegmentImages
from engine.vision.preprocess import ImageError, ImageLimits
from schemas.record import Readout
from schemas.systemone import Question, SystemOneRequest
from schemas.systemone import decode_image as decode_image_b64

Mode = Literal["forest", "per_question"]


class Stages:
    """A loaded engine's decide machinery (the facade, `engine.engine.Engine`, holds one)."""

    def __init__(
        self,
        *,
        runner: Runner,
        tokenizer: Tokenizer,
        decision_config: DecisionConfig,
        cache: PrefixCache,
        tp: TensorParallel | None,
        max_request_tokens: int,
        vision: VisionWeights | None,
        image_limits: ImageLimits,
        max_image_pixels: int,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.prompts = PromptEncoder(tokenizer)
        self.decision_config = decision_config
        self.cache = cache
        self.tp = tp
        self.max_request_tokens = max_request_tokens
        self.vision = vision
        self.vision_tokens = VisionTokens.of(tokenizer) if vision is not None else None
        self.image_limits = image_limits
        self.max_image_pixels = max_image_pixels
        self.grids = GridMemo()
        self.last_counters: list[ForestCounters] = []
        # a decide call's hooks (rank 0): results handed over early, the caller's work between steps
        self._on_ready: Callable[[int, DecideResult], None] | None = None
        self._between_steps: Callable[[], None] | None = None
        self._ready_hook: Callable[[int, list[QuestionRun]], None] | None = None
        self._in_step_hook = False
        if runner.body is not None:  # every read-out reads some of A..Z: gathered in the pass
            runner.body.read_out_letters(self.prompts.letter_ids)
        root = build_forest([Segment(tuple(self.prompts.prefix_ids), None)])
        self.root: SegmentState = self.runner.forest(root).states[0]

    def decide(
        self,
        requests: list[DecideRequest],
        mode: Mode,
        on_ready: Callable[[int, DecideResult], None] | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> list[DecideResult]:
        """`Engine.decide` once the call reached every rank (followers pass no hooks)."""
        outer_step = self._between_steps
        self._on_ready = on_ready
        self._between_steps = between_steps if between_steps is not None else outer_step
        try:
            return self._decide(requests, mode)
        finally:
            self._on_ready = None
            self._between_steps = outer_step

    def _result(self, req: DecideRequest, qs: list[QuestionRun], elapsed: float) -> DecideResult:
        return result(req, qs, elapsed, self.decision_config, self.tokenizer.decode)

    # ------------------------------------------------------------------------------ thoughts
    def _think(
        self,
        thinkers: list[tuple[int, QuestionRun]],
        evidence_ids: list[list[int]],
        evidence_states: list[SegmentState | None],
        mode: Mode,
        evidence_images: list[ImageSet | None],
    ) -> None:
        """Seeded thought decoding for every thinking question at once, then the second read-out.

        The thought starts from a read of the question with `<think>\\n`; every draw is keyed
        by what the model sees (seed, evidence digest, the question's think-prompt tokens) and
        the step, never by the question's key (see `_thought_key`). At the budget, or when
        `</think>` is drawn, the closing tokens are fed and the letters read after them
        (`engine.thoughts.think`, on the decoder or as forests as the path says).
        """
        if self._in_step_hook:  # the outer call's thought state is live
            raise RuntimeError("a decide run between thought steps must not think (gate 0)")
        keep = self._keep_going([q for _, q in thinkers])
        thinkers = [t for t, go in zip(thinkers, keep, strict=True) if go]
        if not thinkers:
            return
        reads = [(r, q, list(range(len(q.option_ids)))) for r, q in thinkers]
        outs = self._read_stage(reads, evidence_ids, evidence_states, mode, evidence_images, think=True)
        started: list[tuple[QuestionRun, torch.Tensor, SegmentState]] = []
        for (_, q, _), (logits, state) in zip(reads, outs, strict=True):
            q.thinking = True
            started.append((q, logits, state))
        closing = tuple(self.prompts.think_close_ids)
        steps: Steps
        if self.runner.path.decoder:
            steps = DecoderSteps(self.runner.decoder, self.decision_config)
        else:
            steps = ForestSteps(self._run, len(closing))
        rules = ThoughtRules(
            config=self.decision_config,
            end_think=self.tokenizer.special.end_think,
            closing=closing,
            key=self._thought_key,
            second_readout=self._second_readout,
            keep_going=self._keep_going,
            step_hook=self._step_hook,
        )
        think(rules, steps, started)

    def _second_readout(self, q: QuestionRun, logits: torch.Tensor) -> None:
        n = len(q.option_ids)
        q.second = single_readout(q.option_ids, self._read_letters(q, logits, n), self._temperature(q))

    def _temperature(self, q: QuestionRun) -> float:
        return self.decision_config.temperature(q.question.type)

    def _keep_going(self, qs: list[QuestionRun]) -> list[bool]:
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
        hook = self._between_steps
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

    # ------------------------------------------------------------------------------ stages
    def read_with_thoughts(self, reads: list[tuple[SystemOneRequest, str, list[int]]]) -> list[Readout]:
        """`Engine.read_with_thought` for many (request, question id, thought) at once: one forest,
        each distinct evidence once."""
        if self.tp is not None:
            raise ValueError("read_with_thought runs on one device, not under tensor parallelism")
        vocab = self.runner.weights.config.vocab_size
        segments: list[Segment] = []
        evidence_index: dict[tuple[int, ...], int] = {}
        read_index: list[int] = []
        questions: list[Question] = []
        for request, qid, thought_ids in reads:
            question = request.questions.get(qid)
            if question is None:
                raise ValueError(f"request has no question {qid!r}")
            n = n_options(question)
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
        readouts = read_letters_many(
            [out.logits[rows[packed[i]]] for i in read_index],
            [self.prompts.letter_token_ids(n_options(question)) for question in questions],
            [dc.temperature(question.type) for question in questions],
            coverage=dc.coverage,
        )
        return [
            single_readout(option_ids(question), ro, dc.temperature(question.type))
            for question, ro in zip(questions, readouts, strict=True)
        ]

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
                    images[r] = self.image_set(req.request)
                except ImageError as e:
                    rejected[r] = f"{INVALID_IMAGE}: {e}"
        stopped = self._stopped_before_start(requests, rejected)
        live = [r for r in range(len(requests)) if r not in rejected and r not in stopped]
        batch: list[list[QuestionRun]] = []
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
                    QuestionRun(
                        qid=qid,
                        question=question,
                        gate=gate,
                        seed=req.seed,
                        event_id=req.request_id,
                        state_text=state_text,
                        rounds=ChoiceRounds(n_options(question)),
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
        on_ready = self._on_ready
        # This call's own hook (None without on_ready): a nested call (between thought steps) must
        # never hand its results to the outer call's on_ready.
        outer_hook = self._ready_hook
        self._ready_hook = None
        if on_ready is not None:

            def ready(i: int, qs: list[QuestionRun]) -> None:
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
            rejected_result(req, rejected[r])
            if r in rejected
            else stopped_result(req, stopped[r])
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

    def image_set(self, request: SystemOneRequest) -> ImageSet:
        """The request's images checked (ImageError on the first unusable one) with their grids."""
        assert self.vision is not None
        datas = []
        for i, s in enumerate(request.images or []):
            try:
                datas.append(decode_image_b64(s))
            except ValueError as e:
                raise ImageError(f"image {i}: {e}") from None
        return ImageSet.check(datas, self.vision, self.image_limits, self.max_image_pixels, self.grids)

    def _decide_stages(
        self,
        batch: list[list[QuestionRun]],
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
            readouts = self._read_many(
                [(q, logits, len(group)) for (_, q, group), (logits, _) in zip(reads, outs, strict=True)]
            )
            for (_, q, _), ro in zip(reads, readouts, strict=True):
                per_question.setdefault(id(q), []).append(ro)
            for _, q in unique_questions(reads):
                q.rounds.submit(per_question[id(q)])
        for qs in batch:
            for q in qs:
                q.first = self._readout(q, q.rounds)

        # AutoThink: questions whose top first probability is below their gate.
        thinkers = [(r, q) for r, qs in enumerate(batch) for q in qs if should_think(q)]
        hook = self._ready_hook
        if hook is not None:  # requests that will not think are final now
            thinking = {r for r, _ in thinkers}
            for r, qs in enumerate(batch):
                if r not in thinking:
                    hook(r, qs)
        if thinkers:
            self._think(thinkers, evidence_ids, evidence_states, mode, evidence_images)

    # ------------------------------------------------------------------------------ stages
    def _question_tokens(self, q: QuestionRun, group: list[int], think: bool) -> list[int]:
        """A read's question-segment tokens, rendered and tokenized once per decide call."""
        key = (tuple(group), think)
        if key not in q.token_memo:
            option_ids = [q.option_ids[i] for i in group] if q.question.type == "choice" else None
            parts = render_parts_for_state_text(q.state_text, q.question, option_ids)
            q.token_memo[key] = self.prompts.question_ids(parts.question_text, think=think)
        return q.token_memo[key]

    def _thought_key(self, q: QuestionRun) -> bytes:
        """The counter key of `q`'s thought: the record seed, the evidence digest and the tokens of
        the think prompt (all options, `<think>\\n` at the end). The question's key and the event
        id are not in it: the same question about the same evidence under the same seed thinks the
        same thought, whatever it is called and however often it is asked."""
        if q.thought_key is None:
            tokens = self._question_tokens(q, list(range(len(q.option_ids))), True)
            q.thought_key = thought_key(q.seed, q.evidence_digest, tokens)
        return q.thought_key

    def _run(self, segments: list[Segment]) -> tuple[ForestOutput, dict[int, int], dict[int, int]]:
        """Run a forest; also return caller index -> packed index, and packed index -> logits row."""
        forest = build_forest(segments)
        out = self.runner.forest(forest)
        self.last_counters.append(out.counters)
        rows = {seg: row for row, seg in enumerate(forest.read_segments)}
        return out, forest.packed_index, rows

    def _read_stage(
        self,
        reads: list[tuple[int, QuestionRun, list[int]]],
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
        if self.runner.body is not None and mode == "forest":
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
                segments.append(Segment(tuple(whole), None, True, self.segment_images(whole, im)))
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
                    segments.append(Segment(key, self.root, images=self.segment_images(key, im)))
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

    def segment_images(self, tokens: Sequence[int], images: ImageSet | None) -> SegmentImages | None:
        """The tower's embeddings and the rope positions of a segment holding `images` (or None)."""
        if images is None:
            return None
        assert self.vision is not None and self.vision_tokens is not None
        return images.segment(
            tokens, self.vision_tokens, self.vision, self.image_limits, self.max_image_pixels
        )

    def _pre_run_images(
        self,
        reads: list[tuple[int, QuestionRun, list[int]]],
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
            segment = Segment(tokens, self.root, images=self.segment_images(tokens, evidence_images[rs[0]]))
            out = self.runner.levels(build_forest([segment]))
            self.last_counters.append(out.counters)
            for r in rs:
                evidence_states[r] = out.states[0]

    def _read_letters(self, q: QuestionRun, logits: torch.Tensor, n: int) -> LetterReadout:
        dc = self.decision_config
        return read_letters(
            logits, self.prompts.letter_token_ids(n), dc.temperature(q.question.type), coverage=dc.coverage
        )

    def _read_many(self, reads: list[tuple[QuestionRun, torch.Tensor, int]]) -> list[LetterReadout]:
        """`_read_letters` of every (question, logits row, letters) of a stage at once: on CUDA one
        sync and one copy back for them all (`read_letters_many`)."""
        dc = self.decision_config
        return read_letters_many(
            [logits for _, logits, _ in reads],
            [self.prompts.letter_token_ids(n) for _, _, n in reads],
            [dc.temperature(q.question.type) for q, _, _ in reads],
            coverage=dc.coverage,
        )

    def _readout(self, q: QuestionRun, rounds: ChoiceRounds) -> Readout:
        return readout_record(q.option_ids, rounds, self.decision_config.temperature(q.question.type))


def unique_questions(reads: list[tuple[int, QuestionRun, list[int]]]) -> list[tuple[int, QuestionRun]]:
    seen: dict[int, tuple[int, QuestionRun]] = {}
    for r, q, _ in reads:
        seen.setdefault(id(q), (r, q))
    return list(seen.values())
