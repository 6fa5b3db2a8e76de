"""The bench's "README's three questions" workload (`bench_engine.README_B`) is the README's example.

`bench_engine.py` times the seed's workload (b) - "README's three questions" - with random token
ids of the lengths the README's example event renders to; the numbers live in the bench so the
GPU machine needs no tokenizer. Here the example is taken from README.md itself, rendered by the
engine's prompt code with the real StartLux vocabulary (the demo model's tokenizer), and its
segment lengths must be the bench's.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ops" / "bench"))

import bench_engine  # noqa: E402

from engine.loading import tokenizer_from_gguf  # noqa: E402
from engine.model.gguf import open_gguf  # noqa: E402
from engine.model.prompt import PromptEncoder, render_parts  # noqa: E402

DEMO_MODEL = ROOT / "prism_pipeline" / "data" / "prism-demo-aiops-q8_0.gguf"


def readme_example() -> dict:
    """The JSON example under README.md's "The event format" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The event format", 1)[1]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block is not None, "README's event format section has no json example"
    return json.loads(block.group(1))


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder(tokenizer_from_gguf(open_gguf(DEMO_MODEL)))


def test_the_readme_example_has_three_questions() -> None:
    assert len(readme_example()["request"]["questions"]) == len(bench_engine.README_QUESTION_TOKENS) == 3


def test_the_bench_lengths_are_the_readme_example_rendered(encoder: PromptEncoder) -> None:
    request = readme_example()["request"]
    evidence, questions = set(), []
    for question in request["questions"].values():
        segments = encoder.encode(render_parts(request["state"], question))
        evidence.add(len(segments.evidence))
        questions.append(len(segments.question))
    assert evidence == {bench_engine.README_EVIDENCE_TOKENS}  # one evidence segment, shared
    assert tuple(questions) == bench_engine.README_QUESTION_TOKENS
    # lighter than the bench's other (b): 220 evidence tokens and three 36-token questions
    assert bench_engine.README_EVIDENCE_TOKENS + sum(questions) < 220 + 3 * 36


def test_the_bench_runs_the_readme_workload_as_one_forest() -> None:
    """`Bench.decide` with per-question lengths: one evidence segment under the root and the
    three question segments under it at the README's lengths, each read once."""
    import torch

    from engine.run.executor import ForestOutput

    seen = []

    class Recording(bench_engine.Bench):
        def run(self, forest):  # the forest the pass would get, and logits for its read rows
            seen.append(forest)
            return ForestOutput(torch.randn(len(forest.read_segments), 600), [], None)

    bench = Recording(weights=None, root=None, device="cpu", g=torch.Generator().manual_seed(0))
    bench.decide(bench_engine.README_EVIDENCE_TOKENS, bench_engine.README_QUESTION_TOKENS)
    (forest,) = seen
    lengths = [len(segment.tokens) for segment in forest.segments]
    assert lengths == [bench_engine.README_EVIDENCE_TOKENS, *bench_engine.README_QUESTION_TOKENS]
    assert forest.parents.tolist() == [-1, 0, 0, 0] and len(forest.read_segments) == 3


def test_a_repeated_variant_runs_again_under_its_own_label() -> None:
    """ "tc64inv,tc64inv-qbf16,tc64inv" brackets the in-process drift: three runs, the last one
    labelled apart (results are keyed by label, so it must not overwrite the first)."""
    import argparse

    args = argparse.Namespace(variants="tc64inv,tc64inv-qbf16,tc64inv,tc64inv")
    runs = bench_engine.variant_settings(args)
    assert [label for label, _ in runs] == ["tc64inv", "tc64inv-qbf16", "tc64inv#2", "tc64inv#3"]
    assert runs[2][1] == runs[0][1] == bench_engine.VARIANTS["tc64inv"]
    with pytest.raises(SystemExit, match="unknown variants"):
        bench_engine.variant_settings(argparse.Namespace(variants="tc64inv,nope"))


def test_gemm_ranges_name_each_gemm_by_its_shape_and_put_the_kernels_back() -> None:
    """The decode profile's per-shape GEMM ranges: a call inside is recorded under its shape (and
    "+res" where a residual is added), its weight's layout noted; outside, the kernels are the
    module's own functions again and the result is the plain call's."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import kernels

    before, before_swiglu = kernels.int8_gemm, kernels.int8_gemm_swiglu
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (4, 64), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=g)
    scales = torch.rand(4, generator=g) + 0.5, torch.rand(32, generator=g) + 0.5
    residual = torch.randn(4, 32, generator=g)
    with bench_engine.gemm_ranges() as seen, profile(activities=[ProfilerActivity.CPU]) as prof:
        inside = kernels.int8_gemm(a, w, *scales, residual)
        kernels.int8_gemm(a, w[:16], *scales[:1], scales[1][:16])
    assert kernels.int8_gemm is before and kernels.int8_gemm_swiglu is before_swiglu
    assert torch.equal(inside, before(a, w, *scales, residual))
    assert set(seen) == {"gemm M=4 N=32 K=64+res", "gemm M=4 N=16 K=64"}
    assert seen["gemm M=4 N=32 K=64+res"] | {"ptr_mod_256": 0} == {
        "m": 4, "n": 32, "k": 64, "contiguous": True, "stride": [64, 1], "ptr_mod_256": 0,
    }  # fmt: skip
    ranges = {e.key: e.count for e in prof.key_averages() if e.key.startswith("gemm ")}
    assert ranges == {"gemm M=4 N=32 K=64+res": 1, "gemm M=4 N=16 K=64": 1}


def test_gemm_range_rates_take_the_range_that_carries_the_kernels_time() -> None:
    """A GEMM range can appear twice in a CUDA profile (its host event without GPU time, its GPU
    annotation with the kernels'): the rate comes from the one with the time. By hand: a 6,400 x
    1,000 int8 weight (6.4 MB) read in 2 us a call is 3.2 TB/s, and its 64 rows' 2 x 64 x 6,400 x
    1,000 = 819.2 M operations in 2 us are 409.6 TOP/s. A range that left no GPU time gets no
    rate instead of a division by zero."""
    from types import SimpleNamespace as Event

    seen = {
        "gemm M=64 N=6400 K=1000": {"m": 64, "n": 6400, "k": 1000},
        "gemm M=64 N=8 K=8": {"m": 64, "n": 8, "k": 8},
    }
    events = [
        Event(key="gemm M=64 N=6400 K=1000", device_time_total=0.0, count=8),
        Event(key="gemm M=64 N=6400 K=1000", device_time_total=16.0, count=8),
        Event(key="gemm M=64 N=8 K=8", device_time_total=0.0, count=4),
        Event(key="_gdn_step_kernel", device_time_total=99.0, count=4),
    ]
    got = bench_engine.gemm_range_rates(events, seen, steps=4)
    assert got["gemm M=64 N=6400 K=1000"] == {
        "us": 2.0,
        "calls_per_step": 2.0,
        "tb_per_s": 3.2,
        "top_per_s": 409.6,
        "m": 64,
        "n": 6400,
        "k": 1000,
    }
    assert got["gemm M=64 N=8 K=8"]["tb_per_s"] is got["gemm M=64 N=8 K=8"]["top_per_s"] is None
    assert set(got) == set(seen)


def test_decode_sequences_parse_a_comma_list_and_refuse_nonsense() -> None:
    """Workload (e)'s sequence counts: "1,64" (the default) or e.g. "32" for the 32-row bucket;
    an empty list or a count below 1 stops the bench before it builds weights."""
    assert bench_engine.decode_sequences("1,64") == [1, 64]
    assert bench_engine.decode_sequences("32") == [32]
    for bad in ("", "0", "1,-4"):
        with pytest.raises(SystemExit, match="positive counts"):
            bench_engine.decode_sequences(bad)


class _RecordingDecoder:
    """A stand-in decoder for `thought_steps`' loop: records each step's feeds and uniforms and
    returns fresh random logits (small vocabulary, so the host sampler draws them)."""

    def __init__(self, draws: bool) -> None:
        self.draws = draws
        self.calls: list[tuple[list[int | None], list[float | None]]] = []
        self.gen = torch.Generator().manual_seed(0)

    def draws_in_step(self) -> bool:
        return self.draws

    def step(self, seqs: list, tokens: list, us: list) -> torch.Tensor:
        self.calls.append((list(tokens), list(us)))
        return torch.randn(len(seqs), 64, generator=self.gen)


@pytest.mark.parametrize("ahead", [False, True])
def test_thought_steps_feed_what_the_loop_feeds(monkeypatch: pytest.MonkeyPatch, ahead: bool) -> None:
    """The bench's decode loop feeds what `engine.thoughts.think` would: the first step the given
    tokens; every later step the token drawn from the step before with that step's uniform - by
    the host (the sampler over the returned logits) or, running ahead, by the step itself (None)."""
    from engine import thoughts
    from engine.decide.sampling import sample_tokens, uniform

    monkeypatch.setattr(thoughts, "RUN_AHEAD", True)
    decoder = _RecordingDecoder(draws=ahead)
    keys = [b"k0", b"k1", b"k2"]
    returned: list = []
    real_step = decoder.step
    decoder.step = lambda *a: returned.append(real_step(*a)) or returned[-1]  # type: ignore[method-assign]
    last = bench_engine.thought_steps(decoder, [object()] * 3, [5, 6, 7], keys, 4)  # type: ignore[arg-type]
    assert last is returned[-1] and len(decoder.calls) == 4
    for step, (tokens, us) in enumerate(decoder.calls, start=1):
        assert us == [uniform(key, step) for key in keys]  # the draw this step makes
        if step == 1:
            assert tokens == [5, 6, 7]
        elif ahead:
            assert tokens == [None, None, None]
        else:
            assert tokens == sample_tokens(
                returned[step - 2], decoder.calls[step - 2][1], **bench_engine.DRAW
            )
