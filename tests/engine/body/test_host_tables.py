"""The one-pass body's host side (`engine.run.body`): the "packed" form's tables, uploads, RoPE
rows and states against the "lists" form (the session-10 path, `HOST_TABLES`), value for value.

Nothing here runs a kernel: the tables are what the GPU reads, so equal tables mean equal bits
(the kernels' own tests are in test_body.py). A body of the small model's sizes with a 1x1 LM
head plans real forests - cached parents made by either form, parents laid out elsewhere (whose
tensors the plan copies), chains deep enough for 8-piece and uncapturable buckets, segments
shorter than the conv window - and loads them into one bucket after another in both forms, so
the packed form's zeroing of what an earlier pass left is checked too.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels.decode_rows import element_offset
from engine.kernels.forest_tables import CONV_TAIL, SEG_CONV_OUT, SEG_STATE_IN, SEG_STATE_OUT
from engine.model.weights import Weights
from engine.quant.linear import QuantLinear
from engine.run.body import PACKED_TABLES, ForestBody, _BlockState, forest_counters
from engine.run.forest import Segment, SegmentState, build_forest
from engine.run.rope import rope_rows
from engine.testing.make_model import dims_config

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
TABLES = ("rows", "segs", "conv_src", "pieces", "qblocks", "reads", "positions")  # a plan's
BUCKET_TABLES = tuple(name for name, _ in PACKED_TABLES if name != "positions")  # a bucket's, packed


def _host_body(device: str) -> ForestBody:
    """The small model's sizes (two attention layers, six DeltaNet layers); no weight is read."""
    head = QuantLinear(torch.ones(1, 1, dtype=torch.int8, device=device), torch.ones(1, device=device))
    zeros = torch.zeros(1, 1, device=device)
    return ForestBody(Weights(dims_config("small"), zeros, torch.zeros(1, device=device), head), graphs=False)


@pytest.fixture(scope="module", params=DEVICES)
def body(request: pytest.FixtureRequest) -> ForestBody:
    return _host_body(request.param)


def _root(body: ForestBody, form: str, n: int = 9) -> SegmentState:
    body.host_tables = form
    forest = build_forest([Segment(tuple(range(50, 50 + n)), None)])
    return body._allocate(forest)[0][0]


def _foreign(body: ForestBody, parent: SegmentState, n: int, g: torch.Generator) -> SegmentState:
    """A state laid out as the level executor leaves one: a tensor per layer (the plan stacks
    copies of its recurrent states and conv tails; its K/V are read in place)."""
    c = body.config
    st = SegmentState(parent=parent, start=parent.end, length=n)
    for i in body.attn_layers:
        st.keys[i] = torch.randn(c.num_kv_heads, n, c.head_dim, generator=g).to(body.device)
        st.values[i] = torch.randn(c.num_kv_heads, n, c.head_dim, generator=g).to(body.device)
    for i in body.gdn_layers:
        shape = (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        st.recurrent[i] = torch.randn(*shape, generator=g).to(body.device)
        st.conv[i] = torch.randn(c.conv_dim, c.conv_kernel - 1, generator=g).to(body.device)
    return st


def _forest_segments(rng: random.Random, parents: list[SegmentState]) -> list[Segment]:
    """Requests under the given outside parents, with in-forest chains of random depth."""
    segs: list[Segment] = []
    for _ in range(rng.randint(1, 3)):
        segs.append(
            Segment(tuple(rng.randrange(5000) for _ in range(rng.randint(1, 40))), rng.choice(parents))
        )
        tip = len(segs) - 1
        for _ in range(rng.randint(0, 4)):
            parent = rng.choice([tip, len(segs) - 1])
            segs.append(
                Segment(tuple(rng.randrange(5000) for _ in range(rng.randint(1, 20))), parent, read=True)
            )
    if rng.random() < 0.3:  # a chain deeper than 4 pieces, sometimes deeper than 8
        for _ in range(rng.choice([4, 9])):
            segs.append(Segment((rng.randrange(5000),), len(segs) - 1, read=True))
    return segs


def _normalized(plan, body: ForestBody) -> dict[str, list]:
    """The plan's tables with every offset into a copy the plan made (`held`) replaced by that
    copy's values and the place in it: two plans make their own copies, at other addresses."""
    copies = [(element_offset(h, body.base), h.numel(), h) for h in plan.held]

    def norm(off: int) -> object:
        for at, n, h in copies:
            if at <= off < at + n:
                return ("held", tuple(h.shape), h.flatten().cpu().tolist(), off - at)
        return off

    segs = plan.segs.tolist()
    for rec in segs:
        for f in (SEG_STATE_IN, SEG_STATE_OUT, SEG_CONV_OUT):
            rec[f] = norm(rec[f])
    conv = [[[k, norm(v) if k == CONV_TAIL else v] for k, v in seg] for seg in plan.conv_src.tolist()]
    pieces = [
        [[[norm(k), norm(v), n, r] for k, v, n, r in slot] for slot in seg] for seg in plan.pieces.tolist()
    ]
    out = {name: getattr(plan, name).tolist() for name in TABLES}
    return out | {"segs": segs, "conv_src": conv, "pieces": pieces}


def _same_views(a: SegmentState, b: SegmentState, block_a: torch.Tensor, block_b: torch.Tensor) -> None:
    for name in ("keys", "values", "recurrent", "conv"):
        da, db = getattr(a, name), getattr(b, name)
        assert list(da) == list(db)
        for i in da:
            ta, tb = da[i], db[i]
            assert ta.shape == tb.shape and ta.stride() == tb.stride() and ta.dtype == tb.dtype
            assert ta.data_ptr() - block_a.data_ptr() == tb.data_ptr() - block_b.data_ptr()


@pytest.mark.parametrize("seed", range(6))
def test_packed_plans_and_loads_equal_the_lists_form(body: ForestBody, seed: int) -> None:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    roots = [_root(body, "packed"), _root(body, "lists")]
    made = []  # states of earlier passes, of both forms
    for form in ("packed", "lists"):
        body.host_tables = form
        forest = build_forest(_forest_segments(rng, roots))
        made += body._allocate(forest)[0]
    parents = [*roots, *rng.sample(made, 3), _foreign(body, roots[0], rng.randint(1, 5), g)]
    for _ in range(4):  # passes into whichever buckets they land in, the forms' loads interleaved
        forest = build_forest(_forest_segments(rng, parents))
        body.host_tables = "packed"
        states, blocks = body._allocate(forest)
        packed = body._plan(forest, states, blocks)
        lists = body._plan_lists(forest, states, blocks)
        assert all(getattr(packed, n).dtype == torch.int64 for n in TABLES)
        assert _normalized(packed, body) == _normalized(lists, body)
        assert packed.levels == lists.levels
        assert packed.positions_end == int(packed.positions.max()) + 1  # the RoPE rows a load needs
        bucket, _ = body._bucket(
            forest.num_tokens, len(forest.segments), packed.pieces.shape[2], packed.levels
        )
        body._load_packed(bucket, packed)
        got = {n: getattr(bucket, n).clone() for n in (*BUCKET_TABLES, "rope")}
        body._load_lists(bucket, packed)  # every table rewritten whole, RoPE rows from the host
        for name, table in got.items():
            assert torch.equal(table, getattr(bucket, name)), name


def test_the_rope_rows_a_packed_load_gathers_are_the_host_rows(body: ForestBody) -> None:
    root = _root(body, "packed", n=3000)  # questions past the first ROPE_BLOCK of positions
    forest = build_forest([Segment(tuple(range(40)), root), Segment((1, 2, 3), 0, read=True)])
    body.host_tables = "packed"
    states, blocks = body._allocate(forest)
    plan = body._plan(forest, states, blocks)
    bucket, _ = body._bucket(forest.num_tokens, len(forest.segments), plan.pieces.shape[2], plan.levels)
    body._load(bucket, plan)
    cos, sin = rope_rows(body.config, plan.positions, torch.float32)
    n = forest.num_tokens
    assert torch.equal(bucket.rope[:n, 0].cpu(), cos) and torch.equal(bucket.rope[:n, 1].cpu(), sin)
    pad = rope_rows(body.config, torch.zeros(1, dtype=torch.int64), torch.float32)
    assert torch.equal(bucket.rope[n:, 0].cpu(), pad[0].expand(bucket.tokens - n, -1))
    body._load(bucket, None)  # all padding: every table zero again, every RoPE row position 0's
    assert all(not getattr(bucket, name).any() for name in BUCKET_TABLES)
    assert torch.equal(bucket.rope[:, 1].cpu(), pad[1].expand(bucket.tokens, -1))


def test_block_states_make_the_views_of_the_lists_form_when_read(body: ForestBody) -> None:
    root = _root(body, "packed")
    forest = build_forest([Segment(tuple(range(30)), root), Segment((7, 8), 0, read=True), Segment((9,), 1)])
    body.host_tables = "packed"
    lazy, lazy_blocks = body._allocate(forest)
    body.host_tables = "lists"
    eager, eager_blocks = body._allocate(forest)
    for s, (a, b) in enumerate(zip(lazy, eager, strict=True)):
        assert isinstance(a, _BlockState) and not isinstance(b, _BlockState)
        assert (a.start, a.length, a.end) == (b.start, b.length, b.end)
        assert (a.parent is None) == (b.parent is None)
        assert a.nbytes() == b.nbytes() == lazy_blocks[s].numel() * 4  # without making the views
        assert "keys" not in a.__dict__
        _same_views(a, b, lazy_blocks[s], eager_blocks[s])
        assert a.nbytes() == b.nbytes()
    assert lazy[1].parent is lazy[0] and lazy[0].parent is root and lazy[2].chain() == [root, *lazy]


def test_a_block_state_whose_views_were_replaced_is_read_through_them(body: ForestBody) -> None:
    root = _root(body, "packed")
    layer = body.attn_layers[0]
    replaced = root.keys[layer].clone()
    root.keys[layer] = replaced
    assert root.block_offset(body._state_shape, body.base) is None
    forest = build_forest([Segment(tuple(range(12)), root, read=True)])
    body.host_tables = "packed"
    states, blocks = body._allocate(forest)
    plan = body._plan(forest, states, blocks)
    assert int(plan.pieces[0, 0, 0, 0]) == element_offset(replaced, body.base)
    assert _normalized(plan, body) == _normalized(body._plan_lists(forest, states, blocks), body)


def test_a_block_states_kept_piece_records_give_way_to_replaced_views(body: ForestBody) -> None:
    """`_BlockState.piece_records` keeps a parent's records from one plan to the next (read-only);
    views replaced after that are read through, as on a state never planned before."""
    root = _root(body, "packed")
    body.host_tables = "packed"
    plans = []
    for _ in range(2):
        forest = build_forest([Segment(tuple(range(12)), root, read=True)])
        states, blocks = body._allocate(forest)
        plans.append(body._plan(forest, states, blocks))
    kept = root.piece_records(body._state_shape, body.base)
    assert kept is not None and not kept.flags.writeable
    assert kept is root.piece_records(body._state_shape, body.base)
    assert torch.equal(plans[0].pieces[:, 0, 0], plans[1].pieces[:, 0, 0])
    assert plans[1].pieces[:, 0, 0].tolist() == kept.tolist()
    layer = body.attn_layers[0]
    root.values[layer] = replaced = root.values[layer].clone()
    assert root.piece_records(body._state_shape, body.base) is None
    forest = build_forest([Segment(tuple(range(12)), root, read=True)])
    states, blocks = body._allocate(forest)
    plan = body._plan(forest, states, blocks)
    assert int(plan.pieces[0, 0, 0, 1]) == element_offset(replaced, body.base)
    assert _normalized(plan, body) == _normalized(body._plan_lists(forest, states, blocks), body)


def _reference_forest(segments: list[Segment]) -> dict:
    """What `build_forest` packs, written plainly (the form before its numpy tables)."""
    n = len(segments)
    level = [0] * n
    for i, seg in enumerate(segments):
        if isinstance(seg.parent, int):
            level[i] = level[seg.parent] + 1
    order = sorted(range(n), key=lambda i: (level[i], i))
    new_index = {old: new for new, old in enumerate(order)}
    packed = []
    for old in order:
        seg = segments[old]
        parent = new_index[seg.parent] if isinstance(seg.parent, int) else seg.parent
        packed.append(Segment(seg.tokens, parent, seg.read, seg.images))
    offsets = [0]
    for seg in packed:
        offsets.append(offsets[-1] + len(seg.tokens))
    starts: list[int] = []
    for seg in packed:
        if isinstance(seg.parent, int):
            starts.append(starts[seg.parent] + len(packed[seg.parent].tokens))
        else:
            starts.append(seg.parent.end if isinstance(seg.parent, SegmentState) else 0)
    reads = [i for i, s in enumerate(packed) if s.read]
    return {
        "segments": packed,
        "tokens": [t for s in packed for t in s.tokens],
        "offsets": offsets,
        "parents": [s.parent if isinstance(s.parent, int) else -1 for s in packed],
        "levels": [level[old] for old in order],
        "starts": starts,
        "read_segments": reads,
        "read_positions": [offsets[i + 1] - 1 for i in reads],
        "packed_index": new_index,
    }


@pytest.mark.parametrize("seed", range(8))
def test_build_forest_packs_as_the_plain_reference(body: ForestBody, seed: int) -> None:
    """Level order whether or not the caller listed the segments in it (a root after a child:
    the packed order moves it), and the tables as int64 tensors of the plain values."""
    rng = random.Random(seed)
    roots: list[SegmentState | None] = [None, _root(body, "packed")]
    if seed == 0:  # in level order: evidence, then its questions
        segs = [Segment((5, 6), roots[1]), Segment((7,), 0, read=True), Segment((8, 9), 0, read=True)]
    else:  # often out of level order: a request's root after the questions of the one before
        segs = _forest_segments(rng, roots)  # type: ignore[arg-type]
    if seed == 1:  # surely out of order
        segs += [Segment((1, 2, 3), roots[0]), Segment((4,), len(segs), read=True)]
    forest, want = build_forest(segs), _reference_forest(segs)
    assert forest.segments == want["segments"] and forest.packed_index == want["packed_index"]
    assert forest.read_segments == want["read_segments"]
    for name in ("tokens", "offsets", "parents", "levels", "starts", "read_positions"):
        table = getattr(forest, name)
        assert table.dtype == torch.int64 and table.dim() == 1 and table.tolist() == want[name], name
    assert forest.num_levels == max(want["levels"]) + 1
    caller_levels = [want["levels"][want["packed_index"][i]] for i in range(len(segs))]
    in_order = caller_levels == sorted(caller_levels)
    assert in_order == (forest.packed_index == {i: i for i in range(len(segs))})
    if seed in (0, 1):  # both orders are covered
        assert in_order == (seed == 0)


def test_unknown_attributes_of_a_block_state_still_raise(body: ForestBody) -> None:
    st = _root(body, "packed")
    with pytest.raises(AttributeError, match="no_such"):
        _ = st.no_such  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(4))
def test_the_counters_count_each_level_as_the_segments_say(seed: int) -> None:
    rng = random.Random(seed)
    forest = build_forest(_forest_segments(rng, [None]))  # type: ignore[list-item]
    counters = forest_counters(forest)
    want_tokens, want_segments = [], []
    for level in range(forest.num_levels):
        segs = forest.level_segments(level)
        want_tokens.append(sum(len(forest.segments[s].tokens) for s in segs))
        want_segments.append(len(segs))
    assert counters.tokens_per_level == want_tokens and counters.segments_per_level == want_segments
    assert counters.read_positions == len(forest.read_segments)
    empty = forest_counters(build_forest([]))
    assert (empty.tokens_per_level, empty.segments_per_level, empty.read_positions) == ([], [], 0)
