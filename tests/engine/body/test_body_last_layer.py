"""The body's last layer at the read rows only (`ForestBody(last_layer="reads")`, the default)
against the full last layer (`last_layer="full"`, the former pass) on the same forests.

What must not move: every state the pass writes (each segment's K/V of every attention layer,
its final DeltaNet states and conv tails: the prefix cache, children and the thought decoder read
them) - bit for bit everywhere. The read logits: the read row's attention now runs in the decode
kernel; unsplit (`read_splits=1`, the default) it performs the 16-row forest kernel's operations
on that row in the same order, so in Triton's interpreter the logits are the full layer's bits;
compiled, the two kernels' builds may lay their reductions out differently, so on CUDA they are
held to the body's tolerance against the level executor (test_body.py). A model whose last layer
is a DeltaNet layer runs the same mixer kernels either way: bits everywhere. Invariance (alone ==
packed == shuffled, cache == recompute, two ranks == one) is test_body.py's, test_body_engine.py's
and test_body_tp.py's, which run the default body.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from body_cases import DEVICE

from engine.engine import Engine
from engine.kernels._triton import interpreting
from engine.kernels.decode_attention import SPLITS
from engine.run.body import ForestBody
from engine.run.executor import ForestOutput
from engine.run.forest import Forest, Segment, SegmentState, build_forest
from engine.testing.make_model import dims_config, make_model

pytestmark = pytest.mark.slow  # the Triton interpreter runs every kernel of every pass


def _tokens(g: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(100, 5000, (n,), generator=g).tolist())


def _forest(root: SegmentState, seed: int, evidence: tuple[int, int] = (21, 37)) -> Forest:
    """Two requests (evidence, questions; a third level under a question), an evidence segment
    with no question, and a root-less read: more reads than the smallest slot bucket's 4 would
    hold, so padding read slots too."""
    g = torch.Generator().manual_seed(seed)
    segs = [Segment(_tokens(g, evidence[0]), root)]
    segs += [Segment(_tokens(g, n), 0, read=True) for n in (4, 9, 1)]
    segs.append(Segment(_tokens(g, evidence[1]), root))
    segs.append(Segment(_tokens(g, 6), 4, read=True))
    segs.append(Segment(_tokens(g, 5), 5, read=True))
    segs.append(Segment(_tokens(g, 11), root))
    segs.append(Segment(_tokens(g, 3), None, read=True))
    return build_forest(segs)


def _states(out: ForestOutput) -> list[tuple[str, torch.Tensor]]:
    got = []
    for s, st in enumerate(out.states):
        for name, per_layer in (("k", st.keys), ("v", st.values), ("s", st.recurrent), ("c", st.conv)):
            got += [(f"{name}{s}.{layer}", t) for layer, t in per_layer.items()]
    return got


def _assert_states_equal(got: ForestOutput, want: ForestOutput) -> None:
    a, b = _states(got), _states(want)
    assert [n for n, _ in a] == [n for n, _ in b] and len(a) > 0
    for (name, x), (_, y) in zip(a, b, strict=True):
        assert torch.equal(x, y), name


def _assert_close_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """test_body.py's agreement with the level executor: same argmax, every row's largest
    difference within 2% of its largest logit (an activation landing one int8 step away)."""
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    errors = ((got - want).abs().amax(-1) / want.abs().amax(-1)).tolist()
    assert max(errors) <= 2e-2, errors


@pytest.fixture(scope="module")
def engine(levels_engine: Engine) -> Engine:
    return levels_engine  # its root and int8 weights; the bodies under test are built here


# the exact body (CPU's default) and CUDA's settings (engine.run.path.CUDA_BODY_SETTINGS)
SETTINGS = {
    "exact": {},
    "chunk-64": dict(gdn_chunk=64, gdn_dots="bf16", attention_dots="bf16", gdn_prep="auto"),
}


@pytest.fixture(scope="module")
def forest(engine: Engine) -> Forest:
    """Every read row's keys span 3-4 of the decode kernel's 64-key chunks (system root,
    evidence, own), so a split read uses 2 of its programs."""
    return _forest(engine.root, seed=11, evidence=(70, 37))


@pytest.fixture(scope="module")
def exact_full(engine: Engine, forest: Forest) -> ForestOutput:
    """The exact body's full last layer on `forest` (two tests compare with it)."""
    return ForestBody(engine.weights, last_layer="full").run(forest)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_reads_only_last_layer_writes_the_full_layers_states_and_read_logits(
    engine: Engine, forest: Forest, exact_full: ForestOutput, setting: str
) -> None:
    assert engine.weights.config.is_full_attention(engine.weights.config.num_layers - 1)
    settings = SETTINGS[setting]
    full = (
        exact_full if not settings else ForestBody(engine.weights, last_layer="full", **settings).run(forest)
    )
    body = ForestBody(engine.weights, **settings)
    assert body.reads_only_last and body.read_splits == 1
    got = body.run(forest)
    _assert_states_equal(got, full)
    assert (
        got.logits.shape == full.logits.shape == (len(forest.read_segments), engine.weights.config.vocab_size)
    )
    if interpreting():
        assert torch.equal(got.logits, full.logits)
    else:
        _assert_close_logits(got.logits, full.logits)


def test_split_read_attention_keeps_the_states_and_the_answers(
    engine: Engine, forest: Forest, exact_full: ForestOutput
) -> None:
    """`read_splits=SPLITS` (the decoder's split over long chains): other fold order, so the read
    logits to the tolerance; the states still bit for bit."""
    got = ForestBody(engine.weights, read_splits=SPLITS).run(forest)
    _assert_states_equal(got, exact_full)
    _assert_close_logits(got.logits, exact_full.logits)


@pytest.fixture(scope="module")
def deltanet_last(module_tmp_path: Path) -> Engine:
    """A tiny int8 model of 5 layers: 3 DeltaNet, 1 attention, and a DeltaNet layer last."""
    config = dims_config("tiny", num_layers=5)
    path = make_model(module_tmp_path / "m.gguf", "Q8_0", config, 2, False, 4)
    return Engine.load(path, device=DEVICE, precision="int8", cache_bytes=0, body=False)


def test_a_deltanet_last_layer_at_the_reads_gives_the_full_layers_bits(deltanet_last: Engine) -> None:
    """The recurrence runs on every row either way (the states), only the output gate, the
    output projection and the MLP move to the read rows: row-local, so bits on every device."""
    c = deltanet_last.weights.config
    assert not c.is_full_attention(c.num_layers - 1) and c.full_attention_layers
    forest = _forest(deltanet_last.root, seed=13)
    full = ForestBody(deltanet_last.weights, last_layer="full").run(forest)
    got = ForestBody(deltanet_last.weights).run(forest)
    _assert_states_equal(got, full)
    assert torch.equal(got.logits, full.logits)


def test_unknown_last_layer_settings_raise(engine: Engine) -> None:
    with pytest.raises(ValueError, match="last_layer must be one of"):
        ForestBody(engine.weights, last_layer="queries")
    with pytest.raises(ValueError, match="read_splits must be >= 1"):
        ForestBody(engine.weights, read_splits=0)
