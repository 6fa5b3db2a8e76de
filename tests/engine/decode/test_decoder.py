"""The thought decoder on CPU (Triton interpreter, eager): against the forest-step path, and
bit-identical logits for a sequence whatever else shares its step, in any order and bucket.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.kernels.draw import DrawSettings
from engine.run.decoder import Decoder
from engine.run.executor import run_forest
from engine.run.forest import Segment, SegmentState, build_forest
from engine.thoughts import fold_into_parent

# CPU: the Triton interpreter (eager); on a CUDA machine the same tests run compiled
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N_SEQ = 16
STEPS = 2


@pytest.fixture(scope="module")
def engine(gguf_model: Callable[..., Path]) -> Engine:
    return Engine.load(
        gguf_model("Q8_0", "tiny", 0, False, 4), device=DEVICE, precision="int8", cache_bytes=0
    )


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[SegmentState]:
    """Question states as `_think` gets them: [system root, evidence, question] chains, two requests."""
    g = torch.Generator().manual_seed(5)
    segs: list[Segment] = []
    for _ in range(2):
        segs.append(Segment(tuple(torch.randint(100, 5000, (23,), generator=g).tolist()), engine.root))
        ev = len(segs) - 1
        for _ in range(N_SEQ // 2):
            n = int(torch.randint(3, 12, (1,), generator=g))
            segs.append(Segment(tuple(torch.randint(100, 5000, (n,), generator=g).tolist()), ev, read=True))
    forest = build_forest(segs)
    out = run_forest(engine.weights, forest)
    return [out.states[forest.packed_index[i]] for i, s in enumerate(segs) if s.read]


def _tokens(seq: int) -> list[int]:
    return [1000 + 37 * seq + 11 * step for step in range(STEPS)]


def test_decoder_matches_the_forest_step_path(engine: Engine, prompts: list[SegmentState]) -> None:
    """Logits of every step agree with `run_forest` fed the same token from the same state.

    Both paths quantize activations to int8; the decoder's fused kernels compute the float ops
    around them in another order (to fp32 rounding), so now and then one activation sits on a
    rounding boundary and lands one int8 step away: that row's logits then differ by that one
    step's worth. So: nearly every row agrees to fp32 rounding, the rare others stay close.
    """
    decoder = Decoder(engine.weights, graphs=False)
    picked = [0, 3, 6, 9, 12, 15]
    seqs = [decoder.start(prompts[i], capacity=STEPS) for i in picked]
    forest_states = [prompts[i] for i in picked]
    errors = []
    for step in range(STEPS):
        tokens = [_tokens(i)[step] for i in picked]
        got = decoder.step(seqs, tokens)
        segs = [Segment((t,), st, read=True) for t, st in zip(tokens, forest_states, strict=True)]
        forest = build_forest(segs)
        out = run_forest(engine.weights, forest)
        scale = out.logits.abs().amax(-1)
        errors += ((got - out.logits).abs().amax(-1) / scale).tolist()
        assert torch.equal(got.argmax(-1), out.logits.argmax(-1))
        states = [out.states[forest.packed_index[j]] for j in range(len(picked))]
        forest_states = [fold_into_parent(st) for st in states] if step else states
    tight = [e for e in errors if e <= 1e-6]
    assert len(tight) >= len(errors) - 1, sorted(errors)[-4:]
    assert max(errors) <= 2e-2


def test_a_sequence_decodes_the_same_alone_and_with_others(
    engine: Engine, prompts: list[SegmentState]
) -> None:
    decoder = Decoder(engine.weights, graphs=False)
    checked = [0, 7, 8, 15]  # both requests' first and last questions
    alone: dict[int, list[torch.Tensor]] = {}
    for i in checked:  # alone: bucket 1
        seq = decoder.start(prompts[i], capacity=STEPS)
        alone[i] = [decoder.step([seq], [_tokens(i)[s]])[0] for s in range(STEPS)]
    # with the 15 others: a new order every step; one step split into groups of 5, 2 and 9
    # rows (buckets 8, 2 and 16), so each checked sequence also runs in other slots and buckets
    rng = random.Random(1)
    seqs = {i: decoder.start(prompts[i], capacity=STEPS) for i in range(N_SEQ)}
    for s in range(STEPS):
        order = list(range(N_SEQ))
        rng.shuffle(order)
        groups = [order] if s != 1 else [order[:5], order[5:7], order[7:]]
        for group in groups:
            logits = decoder.step([seqs[i] for i in group], [_tokens(i)[s] for i in group])
            for row, i in enumerate(group):
                if i in alone:
                    assert torch.equal(logits[row], alone[i][s]), (i, s)


def test_thought_buffers_grow_in_place_and_stop_at_the_capacity(
    engine: Engine, prompts: list[SegmentState]
) -> None:
    decoder = Decoder(engine.weights, graphs=False)
    seq = decoder.start(prompts[3], capacity=70)
    seq.keys = seq.keys[:, :, :2].clone()  # pretend the first allocation was 2 rows
    seq.values = seq.values[:, :, :2].clone()
    decoder._point_own(seq)
    reference = decoder.start(prompts[3], capacity=70)  # 64 rows from the start
    for step in range(5):  # grows 2 -> 4 -> 8 on the way
        a = decoder.step([seq], [300 + step])
        b = decoder.step([reference], [300 + step])
        assert torch.equal(a, b)
    assert seq.allocated == 8 and seq.length == 5
    full = decoder.start(prompts[3], capacity=1)
    decoder.step([full], [5])
    with pytest.raises(ValueError, match="full"):
        decoder.step([full], [6])


@pytest.mark.parametrize("graphs", [False, True] if DEVICE == "cuda" else [False])
def test_a_step_makes_its_samplers_numbers_and_the_draws_stay(
    engine: Engine, prompts: list[SegmentState], monkeypatch: pytest.MonkeyPatch, graphs: bool
) -> None:
    """With `TOP_K_IN_STEP` a step's logits carry the sampler's top-k numbers made in the step (in
    its CUDA graph where it has one): `sample_tokens` takes them, launches no top-k of its own, and
    draws what it draws from a plain copy of the same logits (which carries nothing), for the
    whole block or rows of it in any order. Numbers for another k, or of an earlier step of the
    same bucket (its host buffer since overwritten), are not used: those draws compute their own."""
    import engine.decide.sampling as sampling
    import engine.run.decoder as decoder_module

    monkeypatch.setattr(decoder_module, "TOP_K_IN_STEP", True)
    monkeypatch.setattr(decoder_module, "DRAW_IN_STEP", False)  # (where on, a bucket draws instead)
    decoder = Decoder(engine.weights, graphs=graphs)
    decoder.sample_with(DrawSettings(5, 1.0, 0.95))
    picked = [0, 5, 9]
    seqs = [decoder.start(prompts[i], capacity=STEPS) for i in picked]
    us = [0.1, 0.5, 0.9]
    setting = dict(temperature=1.0, top_p=0.95, top_k=5)
    calls: list[int] = []
    real = sampling.packed_top_k
    monkeypatch.setattr(sampling, "packed_top_k", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    first = decoder.step(seqs, [_tokens(i)[0] for i in picked])
    want = sampling.sample_tokens(first.clone(), us, **setting)
    assert len(calls) == 1  # the copy carries nothing: computed
    assert sampling.sample_tokens(first, us, **setting) == want
    assert sampling.sample_tokens([first[2], first[0]], [us[2], us[0]], **setting) == [want[2], want[0]]
    assert len(calls) == 1  # both from the step's own numbers
    other_k = dict(setting, top_k=4)
    assert sampling.sample_tokens(first, us, **other_k) == sampling.sample_tokens(
        first.clone(), us, **other_k
    )
    assert len(calls) == 3
    second = decoder.step(seqs, [_tokens(i)[1] for i in picked])  # the same bucket again
    assert sampling.sample_tokens(first, us, **setting) == want and len(calls) == 4  # stale: computed
    want_second = sampling.sample_tokens(second.clone(), us, **setting)
    assert sampling.sample_tokens(second, us, **setting) == want_second and len(calls) == 5


@pytest.mark.parametrize(
    "graphs, backend",
    [(False, "auto"), (False, "triton"), (True, "auto")]
    if DEVICE == "cuda"
    else [(False, "auto"), (False, "triton")],
)
def test_a_step_draws_the_samplers_tokens(
    engine: Engine,
    prompts: list[SegmentState],
    monkeypatch: pytest.MonkeyPatch,
    graphs: bool,
    backend: str,
) -> None:
    """With `DRAW_IN_STEP` a step also draws each row's next token with the uniform it was given
    (in its CUDA graph where it has one; on CPU through the torch references, or the kernels in
    Triton's interpreter): `sample_tokens` takes those tokens and draws on the host only the rows
    whose step did not draw with the uniform and settings asked for - a row given no uniform,
    another uniform, other settings, a launch RING launches back - and every token is
    the one the host draws from a plain copy of the same logits (which carries nothing)."""
    import engine.decide.sampling as sampling
    import engine.kernels.draw as draw_module
    import engine.run.decoder as decoder_module

    monkeypatch.setattr(decoder_module, "DRAW_IN_STEP", True)
    monkeypatch.setattr(draw_module, "_STEP_BACKEND", backend)
    settings = DrawSettings(5, 1.0, 0.95)
    decoder = Decoder(engine.weights, graphs=graphs)
    decoder.sample_with(settings)
    picked = [0, 5, 9, 12]
    seqs = [decoder.start(prompts[i], capacity=3) for i in picked]
    us = [0.1, 0.5, 0.9, 0.99]
    given = [us[0], us[1], us[2], None]  # the last row draws nothing in the step
    host_rows: list[int] = []
    real = sampling._top_k_tokens
    monkeypatch.setattr(
        sampling, "_top_k_tokens", lambda rows, *a, **kw: host_rows.append(len(rows)) or real(rows, *a, **kw)
    )
    draw = dict(temperature=1.0, top_p=0.95, top_k=5)
    first = decoder.step(seqs, [_tokens(i)[0] for i in picked], given)
    assert decoder._bucket_cache[4].draw is not None and decoder._bucket_cache[4].top_k is None
    drawn = draw_module.step_drawn_tokens(list(first), us, settings)
    assert [t is not None for t in drawn] == [True, True, True, False]
    host_rows.clear()
    want = sampling.sample_tokens(first.clone(), us, **draw)
    assert host_rows == [4]  # the copy carries nothing
    host_rows.clear()
    assert sampling.sample_tokens(first, us, **draw) == want
    assert host_rows == [1]  # the row given no uniform
    assert drawn[:3] == want[:3]
    host_rows.clear()
    assert sampling.sample_tokens([first[2], first[0]], [us[2], us[0]], **draw) == [want[2], want[0]]
    assert host_rows == []
    other_u = [us[0], 0.25, us[2], us[3]]
    assert sampling.sample_tokens(first, other_u, **draw) == sampling.sample_tokens(
        first.clone(), other_u, **draw
    )
    other = dict(draw, top_p=0.9)
    host_rows.clear()
    assert sampling.sample_tokens(first, us, **other) == sampling.sample_tokens(first.clone(), us, **other)
    assert host_rows == [4, 4]  # other settings: the step's draws do not count
    second = decoder.step(seqs, [_tokens(i)[1] for i in picked], given)  # the same bucket again
    host_rows.clear()
    assert sampling.sample_tokens(first, us, **draw) == want and host_rows == [1]  # still held (RING)
    want_second = sampling.sample_tokens(second.clone(), us, **draw)
    host_rows.clear()
    assert sampling.sample_tokens(second, us, **draw) == want_second and host_rows == [1]
    decoder.step(seqs, [_tokens(i)[1] for i in picked], given)  # and again: the first launch's slot
    host_rows.clear()
    assert sampling.sample_tokens(first, us, **draw) == want and host_rows == [4]  # stale: drawn here
    decoder.sample_with(settings)  # the same settings: the buckets and their graphs stay
    assert 4 in decoder._bucket_cache
    decoder.sample_with(DrawSettings(5, 1.0, 0.9))  # others: buckets drawing with the old ones go
    assert not decoder._bucket_cache


@pytest.mark.parametrize("graphs", [False, True] if DEVICE == "cuda" else [False])
def test_a_step_fed_its_previous_steps_draw_equals_one_fed_that_token(
    engine: Engine, prompts: list[SegmentState], monkeypatch: pytest.MonkeyPatch, graphs: bool
) -> None:
    """A None token feeds a sequence the token its previous launch drew for it, on the device: the
    logits are bit for bit those of the same step fed that token by the host (as the sampler draws
    it), also when the live set shrinks to another bucket (a new graph captured on the way); a
    sequence the previous launch drew nothing for cannot be fed that way."""
    import engine.decide.sampling as sampling
    import engine.run.decoder as decoder_module

    monkeypatch.setattr(decoder_module, "DRAW_IN_STEP", True)
    settings = DrawSettings(5, 1.0, 0.95)
    ahead, host = Decoder(engine.weights, graphs=graphs), Decoder(engine.weights, graphs=graphs)
    for decoder in (ahead, host):
        decoder.sample_with(settings)
    picked = [1, 6, 10, 13]
    a = [ahead.start(prompts[i], capacity=4) for i in picked]
    b = [host.start(prompts[i], capacity=4) for i in picked]
    first = [_tokens(i)[0] for i in picked]
    draw = dict(temperature=1.0, top_p=0.95, top_k=5)
    rng = random.Random(3)
    us = [rng.random() for _ in picked]
    la, lb = ahead.step(a, first, us), host.step(b, first, us)
    assert torch.equal(la, lb)
    for rows in ([0, 1, 2, 3], [3, 1]):  # then bucket 4 -> 2, rows in another order
        tokens = sampling.sample_tokens(lb.clone(), us, **draw)  # what the host draws from the last step
        us = [rng.random() for _ in rows]
        la = ahead.step([a[r] for r in rows], [None] * len(rows), us)
        lb = host.step([b[r] for r in rows], [tokens[r] for r in rows], us)
        assert torch.equal(la, lb), rows
        a, b = [a[r] for r in rows], [b[r] for r in rows]
    with pytest.raises(ValueError, match="drew none"):
        ahead.step([ahead.start(prompts[2], capacity=2)], [None])
    ahead.step(a, [7, 8], None)  # no uniforms: nothing drawn for them
    with pytest.raises(ValueError, match="drew none"):
        ahead.step(a, [None, None])
