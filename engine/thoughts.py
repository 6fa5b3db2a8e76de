"""AutoThink's thought loop, written once for both ways of running a step.

Every step: poll deadlines and cancellation, admit waiting thoughts while there is room, draw one
token for every live thought still thinking (keyed by `engine.decide.sampling.thought_key`, so a
draw never depends on its companions), feed the drawn tokens - or the closing `</think>\\n\\n`
tokens once a thought ends or reaches its budget - and read the letters after the last closing
token. What differs between the paths is only how a step runs (`Steps`):

- `ForestSteps`: each step is a forest of one-token segments, one per live thought, hanging from
  its own question's state; the closing tokens go in as one segment (the CPU/fp32/bf16 paths).
- `DecoderSteps`: one token per step on `engine.run.decoder`'s device buffers (CUDA int8:
  graph-captured; eager under tensor parallelism), the closing tokens one per step too; at most
  `Decoder.max_live` thoughts are live at a time, the others wait with their first logits.

Which thoughts share a step never changes a thought's bits, on either path (the int8 contract).

May import: `engine.run`, `engine.decide`, `engine.questions`, `engine.kernels.draw` (the sampler settings
a step draws with).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.decide.decision_config import DecisionConfig
from engine.decide.sampling import sample_tokens, uniform
from engine.kernels.draw import DrawSettings
from engine.questions import QuestionRun
from engine.run.decoder import Decoder
from engine.run.executor import ForestOutput
from engine.run.forest import Segment, SegmentState


class Steps(Protocol):
    """How one step of the thought loop runs: admit a thought, feed tokens, return next logits."""

    chunk: int  # closing tokens fed per step (the forest takes them all at once)

    def limit(self, capacity: int) -> int:
        """How many thoughts may be live at once when each needs up to `capacity` tokens."""
        ...

    def start(self, state: SegmentState, capacity: int) -> Any:
        """A handle for a thought starting from its question's think-prompt state."""
        ...

    def step(
        self, handles: list[Any], feeds: list[tuple[int, ...]], uniforms: list[float | None]
    ) -> Sequence[torch.Tensor]:
        """Feed each handle its tokens; the next-token logits after each (one row per handle).
        uniforms[j]: the uniform of handle j's next draw, or None (a path that draws in its step
        uses them; the sampler checks each against the one it draws with)."""
        ...

    def close(self) -> None:
        """Give back what the finished thoughts held."""
        ...


@dataclass
class ThoughtRules:
    """What the loop needs from the engine: the sampler's settings, the special tokens, the thought
    keys, the second read-out, and the per-step polls (deadline/cancel, the caller's hook)."""

    config: DecisionConfig
    end_think: int
    closing: tuple[int, ...]
    key: Callable[[QuestionRun], bytes]
    second_readout: Callable[[QuestionRun, torch.Tensor], None]
    keep_going: Callable[[list[QuestionRun]], list[bool]]
    step_hook: Callable[[], None]


@dataclass(eq=False)
class _Live:
    """A live thought: its handle, last logits, and closing progress."""

    q: QuestionRun
    handle: Any
    logits: torch.Tensor
    closed: int | None = None  # closing tokens fed so far, once the thought has ended
    next_draw: tuple[int, float] | None = None  # (draw index, its uniform): hashed once a draw


def think(
    rules: ThoughtRules, steps: Steps, started: list[tuple[QuestionRun, torch.Tensor, SegmentState]]
) -> None:
    """Run every started thought (question, logits after `<think>\\n`, its state) to its second
    read-out, or until a deadline or cancellation cuts it (`QuestionRun.cut`)."""
    dc, closing = rules.config, rules.closing
    waiting = started[::-1]  # pop() admits in the callers' order
    limit = steps.limit(max(q.budget for q, _, _ in started) + len(closing)) if started else 0
    live: list[_Live] = []
    try:
        while live or waiting:
            rules.step_hook()
            keep = rules.keep_going([t.q for t in live] + [q for q, _, _ in waiting])
            n_live = len(live)
            live = [t for t, go in zip(live, keep[:n_live], strict=True) if go]
            waiting = [w for w, go in zip(waiting, keep[n_live:], strict=True) if go]
            if not live and not waiting:
                return
            while waiting and len(live) < limit:
                q, logits, state = waiting.pop()
                live.append(_Live(q, steps.start(state, q.budget + len(closing)), logits))
            drawing = []
            for t in live:
                if t.closed is None and len(t.q.thought_ids) >= t.q.budget:
                    t.q.thought_truncated = True
                    t.closed = 0
                elif t.closed is None:
                    drawing.append(t)
            feeds: dict[int, tuple[int, ...]] = {}
            if drawing:
                tokens = sample_tokens(
                    [t.logits for t in drawing],  # rows, as they came: a step's own top-k travels with them
                    [_uniform(rules, t) for t in drawing],
                    temperature=dc.thought_temperature,
                    top_p=dc.thought_top_p,
                    top_k=dc.thought_top_k,
                )
                for t, token in zip(drawing, tokens, strict=True):
                    if token == rules.end_think:
                        t.closed = 0
                    else:
                        t.q.thought_ids.append(token)
                        feeds[id(t)] = (token,)
            for t in live:
                if t.closed is not None:
                    feeds[id(t)] = closing[t.closed : t.closed + steps.chunk]
            fed = [feeds[id(t)] for t in live]
            logits = steps.step([t.handle for t in live], fed, [_next_uniform(rules, t) for t in live])
            still: list[_Live] = []
            for t, tokens, row in zip(live, fed, logits, strict=True):
                if t.closed is None:
                    t.logits = row
                    still.append(t)
                    continue
                t.closed += len(tokens)
                if t.closed == len(closing):
                    rules.second_readout(t.q, row)
                else:
                    still.append(t)
            live = still
    finally:
        steps.close()


def _next_uniform(rules: ThoughtRules, t: _Live) -> float | None:
    """The uniform of t's next draw, after this step's feed: None where it draws none (closing,
    or its budget reached: the loop closes it instead)."""
    if t.closed is not None or len(t.q.thought_ids) >= t.q.budget:
        return None
    return _uniform(rules, t)


def _uniform(rules: ThoughtRules, t: _Live) -> float:
    """The uniform of t's draw number len(thought_ids) (the step feeds it, the sampler draws with
    it: one hash for both)."""
    index = len(t.q.thought_ids)
    if t.next_draw is None or t.next_draw[0] != index:
        t.next_draw = (index, uniform(rules.key(t.q), index))
    return t.next_draw[1]


@dataclass(eq=False)
class _ForestThought:
    state: SegmentState
    fresh: SegmentState | None = None  # the last step's segment, folded in when the next step runs


class ForestSteps:
    """Thought steps as forests of one segment per live thought (`run` runs a list of segments and
    returns the output, caller index -> packed index, packed index -> logits row)."""

    def __init__(
        self,
        run: Callable[[list[Segment]], tuple[ForestOutput, dict[int, int], dict[int, int]]],
        closing: int,
    ) -> None:
        self._run = run
        self.chunk = closing

    def limit(self, capacity: int) -> int:
        return 1 << 30  # every thought at once: a forest has no fixed buffers

    def start(self, state: SegmentState, capacity: int) -> _ForestThought:
        return _ForestThought(state)

    def step(
        self, handles: list[_ForestThought], feeds: list[tuple[int, ...]], uniforms: list[float | None]
    ) -> list[torch.Tensor]:
        for h in handles:
            if h.fresh is not None:
                h.state, h.fresh = fold_into_parent(h.fresh), None
        out, packed, rows = self._run(
            [Segment(tokens, h.state, read=True) for h, tokens in zip(handles, feeds, strict=True)]
        )
        for i, h in enumerate(handles):
            h.fresh = out.states[packed[i]]
        return [out.logits[rows[packed[i]]] for i in range(len(handles))]

    def close(self) -> None:
        pass


class DecoderSteps:
    """Thought steps on `engine.run.decoder` (one token per thought per step). With a top-k sampler
    (temperature > 0, 0 < top_k < vocabulary) the steps also do its device part in their graphs
    (`Decoder.sample_with`: its top-k numbers, or its tokens drawn with each row's next uniform),
    which `sample_tokens` finds with the rows."""

    chunk = 1

    def __init__(self, decoder: Decoder, config: DecisionConfig) -> None:
        self.decoder = decoder
        k = config.thought_top_k
        if config.thought_temperature > 0.0 and 0 < k < decoder.config.vocab_size:
            decoder.sample_with(DrawSettings(k, config.thought_temperature, config.thought_top_p))

    def limit(self, capacity: int) -> int:
        return self.decoder.max_live(capacity)

    def start(self, state: SegmentState, capacity: int) -> Any:
        return self.decoder.start(state, capacity)

    def step(
        self, handles: list[Any], feeds: list[tuple[int, ...]], uniforms: list[float | None]
    ) -> torch.Tensor:
        assert all(len(f) == 1 for f in feeds)
        return self.decoder.step(handles, [f[0] for f in feeds], uniforms)

    def close(self) -> None:
        self.decoder.forget()  # finished thoughts' states and buffers go back to the allocator


def fold_into_parent(state: SegmentState) -> SegmentState:
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
