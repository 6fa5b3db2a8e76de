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
