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
  `Decoder.max_live` thoughts are live at a time, the others wait with their first logits. Its
  steps draw the next tokens in their graphs, so the loop runs one step ahead (`RUN_AHEAD`): a
  step is queued fed the previous step's own draws, and the previous step is read while it runs.

Which thoughts share a step never changes a thought's bits, on either path (the int8 contract).

May import: `engine.run`, `engine.decide`, `engine.questions`, `engine.kernels.draw` (the sampler
settings a step draws with).
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

# Whether the loop queues each decoder step before reading the previous one, feeding every thought
# still thinking its previous step's own draw (`think`; needs the decoder's draw in the step,
# `engine.run.decoder.DRAW_IN_STEP`): the same thoughts, with the host's work per step (reading the
# tokens, the table of the next step) done while the device runs. On since session 32 (H100, 27B,
# beside the draw in the step alone: 64 sequences 2,865 -> 2,902-2,927 tokens/s, one sequence
# 91.4 -> 92.7; ops/bench/RESULTS.md).
RUN_AHEAD = True


class Steps(Protocol):
    """How one step of the thought loop runs: admit a thought, feed tokens, return next logits."""

    chunk: int  # closing tokens fed per step (the forest takes them all at once)
    ahead: bool  # whether a step may feed a handle its previous step's own draw (a None feed)

    def limit(self, capacity: int) -> int:
        """How many thoughts may be live at once when each needs up to `capacity` tokens."""
        ...

    def start(self, state: SegmentState, capacity: int) -> Any:
        """A handle for a thought starting from its question's think-prompt state."""
        ...

    def step(
        self, handles: list[Any], feeds: list[tuple[int, ...] | None], uniforms: list[float | None]
    ) -> Sequence[torch.Tensor]:
        """Feed each handle its tokens (None, where `ahead`: the token its previous step drew);
        the next-token logits after each (one row per handle). uniforms[j]: the uniform of handle
        j's next draw, or None (a path that draws in its step uses them; the sampler checks each
        against the one it draws with)."""
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
    """A live thought: its handle, the logits the host draws its next token from, closing progress."""

    q: QuestionRun
    handle: Any
    logits: torch.Tensor | None  # None: its next token is its last step's own draw (ahead)
    closed: int | None = None  # closing tokens fed so far, once the thought has ended
    done: bool = False  # every closing token fed: only its second read-out is left
    finished: bool = False  # read out, or cut
    next_draw: tuple[int, float] | None = None  # (draw index, its uniform): hashed once a draw


@dataclass(eq=False)
class _Launch:
    """One step's thoughts, what each was fed (None: its previous step's draw) and the logits."""

    thoughts: list[_Live]
    feeds: list[tuple[int, ...] | None]
    last: list[bool]  # whether the feed completed that thought's closing tokens
    logits: Sequence[torch.Tensor]


def think(
    rules: ThoughtRules, steps: Steps, started: list[tuple[QuestionRun, torch.Tensor, SegmentState]]
) -> None:
    """Run every started thought (question, logits after `<think>\\n`, its state) to its second
    read-out, or until a deadline or cancellation cuts it (`QuestionRun.cut`).

    Where the steps draw the next tokens themselves and may feed them on (`steps.ahead`), a step
    is queued before the previous one is read: each thought still thinking is fed its previous
    step's own draw, and that step's results are read (the tokens appended, `</think>` seen, the
    read-outs taken) while the next runs, so the device never waits for the host. What is fed is
    the same either way: the token the sampler draws from those logits with that uniform (the
    step's draw is that token), `</think>` included, since the closing tokens start with it.
    """
    closing = rules.closing
    if steps.ahead and closing[:1] != (rules.end_think,):
        raise ValueError("feeding a step's own draws on needs closing tokens that start with </think>")
    waiting = started[::-1]  # pop() admits in the callers' order
    limit = steps.limit(max(q.budget for q, _, _ in started) + len(closing)) if started else 0
    live: list[_Live] = []
    unread: _Launch | None = None  # ahead: the last launch, read once the next one is queued
    try:
        while live or waiting:
            rules.step_hook()
            feeding = [t for t in live if not t.done]
            keep = rules.keep_going([t.q for t in feeding] + [q for q, _, _ in waiting])
            for t, go in zip(feeding, keep[: len(feeding)], strict=True):
                t.finished = not go  # cut
            waiting = [w for w, go in zip(waiting, keep[len(feeding) :], strict=True) if go]
            live = [t for t in live if not t.finished]
            if not live and not waiting:
                return
            while waiting and len(live) < limit:
                q, logits, state = waiting.pop()
                live.append(_Live(q, steps.start(state, q.budget + len(closing)), logits))
            launch = _launch(rules, steps, [t for t in live if not t.done])
            if steps.ahead:
                if unread is not None:
                    _read(rules, unread, launch)
                unread = launch
            elif launch is not None:
                _read(rules, launch, None)
            live = [t for t in live if not t.finished]
    finally:
        steps.close()


def _launch(rules: ThoughtRules, steps: Steps, feeding: list[_Live]) -> _Launch | None:
    """The next step for the thoughts still being fed: draw where the host draws (a thought's first
    token; every token unless ahead), close at the budget or `</think>`, feed, and queue the step."""
    if not feeding:
        return None
    dc, closing = rules.config, rules.closing
    drawing = []
    for t in feeding:
        if t.closed is None and len(t.q.thought_ids) >= t.q.budget:
            t.q.thought_truncated = True
            t.closed = 0
        elif t.closed is None and t.logits is not None:
            drawing.append(t)
    drawn: set[int] = set()  # the thoughts whose next token the host just drew
    if drawing:
        tokens = sample_tokens(
            [t.logits for t in drawing],  # rows, as they came: a step's own numbers travel with them
            [_uniform(rules, t, len(t.q.thought_ids)) for t in drawing],
            temperature=dc.thought_temperature,
            top_p=dc.thought_top_p,
            top_k=dc.thought_top_k,
        )
        for t, token in zip(drawing, tokens, strict=True):
            t.logits = None
            if token == rules.end_think:
                t.closed = 0
            else:
                t.q.thought_ids.append(token)
                drawn.add(id(t))
    feeds: list[tuple[int, ...] | None] = []
    last: list[bool] = []
    uniforms: list[float | None] = []
    for t in feeding:
        fed = len(t.q.thought_ids)  # thought tokens fed once this step has run
        feed: tuple[int, ...] | None
        if t.closed is not None:
            feed = closing[t.closed : t.closed + steps.chunk]
            t.closed += len(feed)
            t.done = t.closed == len(closing)
        elif id(t) in drawn:
            feed = (t.q.thought_ids[-1],)
        else:  # ahead: its previous step's own draw, read once this step is queued
            assert steps.ahead
            feed, fed = None, fed + 1
        feeds.append(feed)
        last.append(t.done)
        uniforms.append(_uniform(rules, t, fed) if t.closed is None and fed < t.q.budget else None)
    logits = steps.step([t.handle for t in feeding], feeds, uniforms)
    return _Launch(feeding, feeds, last, logits)


def _read(rules: ThoughtRules, launch: _Launch, next_launch: _Launch | None) -> None:
    """A step's results: the second read-out of every thought it closed; for a thought still
    thinking, its next token - read now where the next step was fed that step's own draw (ahead:
    `next_launch`), else drawn from these logits when the next step is planned."""
    dc, closing = rules.config, rules.closing
    fed_on: dict[int, int] = {}  # thought -> its place in the next step, where fed this step's draw
    if next_launch is not None:
        for i, (t, feed) in enumerate(zip(next_launch.thoughts, next_launch.feeds, strict=True)):
            if feed is None:
                fed_on[id(t)] = i
    reading = []
    for t, done, row in zip(launch.thoughts, launch.last, launch.logits, strict=True):
        if t.finished:
            continue  # cut
        if done:
            rules.second_readout(t.q, row)
            t.finished = True
        elif t.closed is None and id(t) in fed_on:
            reading.append((t, row))
        elif t.closed is None and next_launch is None:
            t.logits = row
    if not reading:
        return
    tokens = sample_tokens(
        [row for _, row in reading],  # the step's own draws: the tokens the next step was fed
        [_uniform(rules, t, len(t.q.thought_ids)) for t, _ in reading],
        temperature=dc.thought_temperature,
        top_p=dc.thought_top_p,
        top_k=dc.thought_top_k,
    )
    assert next_launch is not None
    for (t, _), token in zip(reading, tokens, strict=True):
        if token != rules.end_think:
            t.q.thought_ids.append(token)
            continue
        t.closed = 1  # the next step fed it </think>, the first closing token
        if len(closing) == 1:
            t.done = True
            next_launch.last[fed_on[id(t)]] = True


def _uniform(rules: ThoughtRules, t: _Live, index: int) -> float:
    """The uniform of t's draw number `index` (a step draws with it, the sampler draws with it:
    one hash for both)."""
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
        self.ahead = False

    def limit(self, capacity: int) -> int:
        return 1 << 30  # every thought at once: a forest has no fixed buffers

    def start(self, state: SegmentState, capacity: int) -> _ForestThought:
        return _ForestThought(state)

    def step(
        self,
        handles: list[_ForestThought],
        feeds: list[tuple[int, ...] | None],
        uniforms: list[float | None],
    ) -> list[torch.Tensor]:
        for h in handles:
            if h.fresh is not None:
                h.state, h.fresh = fold_into_parent(h.fresh), None
        out, packed, rows = self._run(
            [Segment(tokens or (), h.state, read=True) for h, tokens in zip(handles, feeds, strict=True)]
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
        self.ahead = RUN_AHEAD and decoder.draws_in_step()

    def limit(self, capacity: int) -> int:
        return self.decoder.max_live(capacity)

    def start(self, state: SegmentState, capacity: int) -> Any:
        return self.decoder.start(state, capacity)

    def step(
        self, handles: list[Any], feeds: list[tuple[int, ...] | None], uniforms: list[float | None]
    ) -> torch.Tensor:
        assert all(f is None or len(f) == 1 for f in feeds)
        return self.decoder.step(handles, [None if f is None else f[0] for f in feeds], uniforms)

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
