"""The one-pass forest body (`engine.run.body`) on the tiny int8 model: against the level-by-level
executor, and bit-identical results for a segment whatever else shares its pass, whichever
bucket runs it, and whether its parent was computed in the pass or kept from an earlier one.

CPU runs the kernels in Triton's interpreter, eagerly; on a CUDA machine the same tests run the
compiled kernels with one CUDA graph per bucket.
"""

from __future__ import annotations

import pytest
import torch

from engine.decide.readout import _device_masses, read_letters_many
from engine.engine import Engine
from engine.kernels.attached import attached
from engine.kernels.vocab_mass import ReadsTicket
from engine.run import body as body_module
from engine.run.body import ForestBody
from engine.run.executor import run_forest
from engine.run.forest import Segment, SegmentState, build_forest


@pytest.fixture(scope="module")
def engine(levels_engine: Engine) -> Engine:
    # the level executor's engine: its root and weights are shared by both paths under test
    return levels_engine


@pytest.fixture(scope="module")
def body(engine: Engine) -> ForestBody:
    return ForestBody(engine.weights)


def _tokens(g: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(100, 5000, (n,), generator=g).tolist())


def _request(g: torch.Generator, root: SegmentState, evidence: int, questions: list[int]) -> list[Segment]:
    """Evidence under the system root, questions under the evidence (indices local to the list)."""
    segs = [Segment(_tokens(g, evidence), root)]
    segs += [Segment(_tokens(g, n), 0, read=True) for n in questions]
    return segs


def _pack(requests: list[list[Segment]]) -> tuple[list[Segment], list[list[int]]]:
    """Concatenate requests into one forest's segment list; per request its indices there."""
    segs: list[Segment] = []
    where: list[list[int]] = []
    for req in requests:
        base = len(segs)
        where.append(list(range(base, base + len(req))))
        for s in req:
            parent = s.parent + base if isinstance(s.parent, int) else s.parent
            segs.append(Segment(s.tokens, parent, s.read))
    return segs, where


def _run(body: ForestBody, segs: list[Segment]):
    forest = build_forest(segs)
    out = body.run(forest)
    rows = {seg: row for row, seg in enumerate(forest.read_segments)}
    return out, forest, rows


def _result(out, forest, rows, indices: list[int], segs: list[Segment]) -> list[tuple[str, torch.Tensor]]:
    """Everything a request's segments produced: read logits, own K/V, final states and tails."""
    got = []
    for j, i in enumerate(indices):  # names by position in the request, not in the forest
        p = forest.packed_index[i]
        st = out.states[p]
        if segs[i].read:
            got.append((f"logits{j}", out.logits[rows[p]]))
        for layer in st.keys:
            got += [(f"k{j}.{layer}", st.keys[layer]), (f"v{j}.{layer}", st.values[layer])]
        for layer in st.recurrent:
            got += [(f"s{j}.{layer}", st.recurrent[layer]), (f"c{j}.{layer}", st.conv[layer])]
    return got


def _assert_same_bits(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, x), (_, y) in zip(a, b, strict=True):
        assert torch.equal(x, y), name


def test_body_agrees_with_the_level_executor(engine: Engine, body: ForestBody) -> None:
    """Logits at every read agree with `run_forest` on the same forest (two requests, three levels).

    Both quantize activations to int8 with the same arithmetic; the body's fused kernels compute
    the float ops around them in another order (to fp32 rounding), so now and then an activation
    sits on a rounding boundary and lands one int8 step away: most rows agree to fp32 rounding,
    the others stay close, and the argmax (the answer) is the same.
    """
    g = torch.Generator().manual_seed(3)
    first = _request(g, engine.root, 21, [4, 9, 1])
    second = _request(g, engine.root, 37, [6])
    second.append(Segment(_tokens(g, 5), 1, read=True))  # a third level under a question
    segs, _ = _pack([first, second])
    forest = build_forest(segs)
    got = body.run(forest)
    want = run_forest(engine.weights, forest)
    assert got.logits.shape == want.logits.shape
    assert got.counters == want.counters
    scale = want.logits.abs().amax(-1)
    errors = ((got.logits - want.logits).abs().amax(-1) / scale).tolist()
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
    assert max(errors) <= 2e-2, errors
    for st_got, st_want in zip(got.states, want.states, strict=True):
        assert (st_got.start, st_got.length) == (st_want.start, st_want.length)
        pairs = [(st_got.keys, st_want.keys), (st_got.values, st_want.values)]
        pairs += [(st_got.recurrent, st_want.recurrent), (st_got.conv, st_want.conv)]
        for mine, theirs in pairs:
            assert mine.keys() == theirs.keys()
            for layer in theirs:
                torch.testing.assert_close(mine[layer], theirs[layer].float(), rtol=0.05, atol=0.05)


# the default body, one with every opt-in precision setting (chunked GDN on tf32 products,
# bf16 attention dots), and CUDA's settings (engine.run.path.CUDA_BODY_SETTINGS: chunk-64 GDN,
# whose outputs launch also writes the padding rows, so `o` starts uninitialised): other
# rounding, the same invariance
BODY_SETTINGS = {
    "exact": {},
    "tensor-cores": dict(gdn_chunk=16, gdn_dots="tf32", attention_dots="bf16"),
    "chunk-64": dict(gdn_chunk=64, gdn_dots="bf16", attention_dots="bf16", gdn_prep="auto"),
}


@pytest.mark.parametrize("setting", sorted(BODY_SETTINGS))
def test_a_request_has_the_same_bits_alone_and_among_others(engine: Engine, setting: str) -> None:
    body = ForestBody(engine.weights, **BODY_SETTINGS[setting])
    g = torch.Generator().manual_seed(4)
    a = _request(g, engine.root, 19, [3, 7])
    b = _request(g, engine.root, 40, [2, 2, 11])
    c = [Segment(_tokens(g, 6), None, read=True)]  # a sequence start, no system root
    alone_segs, alone_where = _pack([a])
    alone = _result(*_run(body, alone_segs), alone_where[0], alone_segs)
    for order in ([b, a, c], [c, b, a]):
        segs, where = _pack(order)
        k = next(j for j, r in enumerate(order) if r is a)
        _assert_same_bits(alone, _result(*_run(body, segs), where[k], segs))


def test_a_parent_kept_from_an_earlier_pass_gives_the_bits_of_one_computed_in_the_pass(
    engine: Engine, body: ForestBody
) -> None:
    g = torch.Generator().manual_seed(6)
    req = _request(g, engine.root, 26, [5, 8])
    together = _result(*_run(body, req), [1, 2], req)
    out, forest, _ = _run(body, [req[0]])
    evidence = out.states[forest.packed_index[0]]
    later = [Segment(s.tokens, evidence, s.read) for s in req[1:]]
    apart = _result(*_run(body, later), [0, 1], later)
    assert len(together) > 0
    _assert_same_bits(together, apart)


def test_the_bucket_a_forest_lands_in_does_not_change_its_bits(
    engine: Engine, body: ForestBody, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(8)
    segs = _request(g, engine.root, 23, [4, 6])
    expected = _result(*_run(body, segs), [0, 1, 2], segs)
    # No ladder entry fits: the pass runs in exact-size tables (eager, never captured).
    monkeypatch.setattr(body_module, "TOKEN_BUCKETS", (16,))
    monkeypatch.setattr(body_module, "SEGMENT_BUCKETS", (1,))
    exact = ForestBody(engine.weights)
    _assert_same_bits(expected, _result(*_run(exact, segs), [0, 1, 2], segs))


def test_the_chunked_recurrence_agrees_with_the_token_by_token_one(engine: Engine, body: ForestBody) -> None:
    """gdn_chunk=16 over segments longer than a chunk: the same answers, logits to int8 rounding."""
    g = torch.Generator().manual_seed(9)
    segs = _request(g, engine.root, 45, [20, 3])
    forest = build_forest(segs)
    want = body.run(forest).logits
    got = ForestBody(engine.weights, gdn_chunk=16).run(forest).logits
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    errors = ((got - want).abs().amax(-1) / want.abs().amax(-1)).tolist()
    assert max(errors) <= 2e-2, errors


def test_unknown_precision_settings_raise(engine: Engine) -> None:
    with pytest.raises(ValueError, match="attention_dots one of"):
        ForestBody(engine.weights, attention_dots="fp8")
    with pytest.raises(ValueError, match="gdn_dots must be one of"):
        ForestBody(engine.weights, gdn_dots="bf16")
    with pytest.raises(ValueError, match="gdn_prep must be one of"):
        ForestBody(engine.weights, gdn_chunk=64, gdn_dots="bf16", gdn_prep="solve")


def test_auto_gdn_prep_is_a_function_of_the_head_sizes(engine: Engine) -> None:
    """ "auto" takes the invert form exactly where it runs compiled (head sizes that are multiples
    of 64: every released model) and the blocks form elsewhere (the tiny test heads); an explicit
    form is kept as given."""
    c = engine.weights.config
    fits = c.linear_key_head_dim % 64 == 0 and c.linear_value_head_dim % 64 == 0
    auto = ForestBody(engine.weights, gdn_chunk=64, gdn_dots="bf16", gdn_prep="auto")
    assert auto.gdn_prep == ("invert" if fits else "blocks")
    assert ForestBody(engine.weights, gdn_chunk=64, gdn_dots="bf16", gdn_prep="invert").gdn_prep == "invert"


def test_read_outs_fold_the_numbers_their_pass_made(engine: Engine) -> None:
    """A body whose buckets make the read-outs' numbers in the pass (`reads_in_pass`: the CUDA
    default, in the captured graph; forced here on CPU, eagerly): its logits carry them, and a
    read-out folds them into the values its own kernels give the same rows (independent oracle:
    the rows of a copy, which carries nothing). A later pass of the same bucket, or letters the
    pass did not gather, send the read-out back to its kernels, over the logits it kept."""
    body = ForestBody(engine.weights)
    body.reads_in_pass = True
    letters = engine.prompts.letter_ids
    with pytest.raises(ValueError, match="distinct"):
        body.read_out_letters([letters[0], letters[0]])
    with pytest.raises(ValueError, match="distinct"):
        body.read_out_letters([engine.config.vocab_size])
    body.read_out_letters(letters)
    g = torch.Generator().manual_seed(11)
    out, _, _ = _run(body, _request(g, engine.root, 40, [7, 9]))
    block, plain = out.logits, out.logits.clone()
    ticket = attached(block, ReadsTicket)
    assert ticket is not None and attached(plain, ReadsTicket) is None
    ids = [letters[:4], letters[:26:5]]
    want = _device_masses([plain[1], plain[0]], ids)
    assert ticket.values([1, 0], ids) is not None
    assert _device_masses([block[1], block[0]], ids) == want
    if block.is_cuda:  # the engine's read-out: CUDA rows take the device form
        temps = [1.0, 0.7]
        assert read_letters_many([block[1], block[0]], ids, temps) == read_letters_many(
            [plain[1], plain[0]], ids, temps
        )
    unknown = [[letters[0], 3], letters[:1]]
    assert ticket.values([1, 0], unknown) is None
    assert _device_masses([block[1], block[0]], unknown) == _device_masses([plain[1], plain[0]], unknown)
    _run(body, _request(g, engine.root, 40, [7, 9]))  # the same bucket, launched again
    assert ticket.values([1, 0], ids) is None
    assert _device_masses([block[1], block[0]], ids) == want


def test_bf16_queries_from_the_prep_give_the_bits_of_fp32_ones(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`forest_attention.QUERIES_BF16` (bf16 dots round every query before its first product, so
    the prep may store them rounded): the same logits, K/V and states as fp32 queries, for a pass
    with long segments (the large-block tiers) and questions after them."""
    from engine.kernels import forest_attention as fa

    settings = dict(BODY_SETTINGS["chunk-64"])
    g = torch.Generator().manual_seed(8)
    segs, where = _pack([_request(g, engine.root, 90, [3, 7]), _request(g, engine.root, 40, [5])])
    results = []
    for bf16 in (False, True):
        monkeypatch.setattr(fa, "QUERIES_BF16", bf16)
        body = ForestBody(engine.weights, **settings)
        results.append([_result(*_run(body, segs), w, segs) for w in where])
    for a, b in zip(*results, strict=True):
        _assert_same_bits(a, b)
