"""The int8 contract with images in evidence: a question about an image has the same bits alone,
in any batch (with text-only requests, other images, the same image under other text), in any
order, from the prefix cache (which then skips the vision tower) and in one-segment mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import engine.vision.evidence as evidence_module
from engine.decide.decision_config import DecisionConfig
from engine.engine import Engine
from engine.loading import file_digest
from engine.testing.images import b64, random_image
from engine.testing.make_model import DIMS, make_mmproj, make_model
from engine.types import DecideRequest
from engine.vision.preprocess import prepare_image
from engine.vision.tower import encode_image
from schemas.systemone import SystemOneRequest

QUESTIONS = {
    "down": {"type": "noul", "instructions": "Does the graph show an outage?"},
    "where": {"type": "choice", "criteria": {"api": None, "db": "database", "net": "network"}},
}
CACHE_BYTES = 1 << 26


def _req(event_id: str, state: str, images: list[bytes], seed: int = 0) -> DecideRequest:
    body = {"state": state, "questions": QUESTIONS}
    if images:
        body["images"] = [b64(d) for d in images]
    return DecideRequest(event_id, SystemOneRequest.model_validate(body), seed=seed)


@pytest.fixture(scope="module")
def engine(module_tmp_path: Path) -> Engine:
    root = module_tmp_path
    model = make_model(root / "tiny-Q8_0.gguf", "Q8_0", "tiny", 0, outliers=4)
    make_mmproj(root / "mmproj-tiny.gguf", DIMS["tiny"], 0)
    return Engine.load(
        model, precision="int8", decision_config=DecisionConfig(gate=0.0), cache_bytes=CACHE_BYTES
    )


@pytest.fixture(scope="module")
def pictures() -> list[bytes]:
    return [
        random_image(200, 300, seed=1),
        random_image(64, 400, fmt="JPEG", seed=2),
        random_image(90, 90, seed=3),
    ]


def test_question_about_an_image_has_the_same_bits_alone_batched_and_cached(
    engine: Engine, pictures: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = _req("t", "dashboard: checkout p99", [pictures[0]])
    others = [
        _req("x", "dashboard: checkout p99", []),  # same text, no image
        _req("y", "dashboard: checkout p99", [pictures[1]]),  # same text, another image
        _req("z", "disk 97% on db-3", [pictures[0], pictures[2]]),  # the image among others
        _req("w", "dashboard: checkout p99", [pictures[0]], seed=5),  # identical evidence, other seed
    ]
    engine.cache.clear()
    (alone,) = engine.decide([target])
    engine.cache.clear()
    batch = engine.decide([others[0], others[1], target, others[2], others[3]])
    engine.cache.clear()
    reordered = engine.decide([others[3], target, others[2], others[1], others[0]])
    assert alone.error is None
    assert batch[2].traces == alone.traces == reordered[1].traces
    # other images, or none, are other evidence: they change the answer
    assert batch[0].traces != alone.traces and batch[1].traces != alone.traces

    calls: list[int] = []
    real = evidence_module.encode_image
    monkeypatch.setattr(evidence_module, "encode_image", lambda *a: calls.append(1) or real(*a))
    hits = engine.cache.stats.hits
    (cached,) = engine.decide([target])  # the evidence (with its image) is in the cache now
    assert engine.cache.stats.hits == hits + 1 and calls == []  # a hit skips the tower
    assert cached.traces == alone.traces
    (one_segment,) = engine.decide([target], mode="per_question")
    assert one_segment.traces == alone.traces and calls == [1]


def test_the_cache_keys_on_the_image_not_only_its_tokens(engine: Engine, pictures: list[bytes]) -> None:
    # two images of the same size take the same tokens; only their digests tell them apart
    same_size = [random_image(200, 300, seed=10), random_image(200, 300, seed=11)]
    engine.cache.clear()
    hits = engine.cache.stats.hits  # the module's engine: its counters run on across tests
    first = engine.decide([_req("a", "graph", [same_size[0]])])[0]
    second = engine.decide([_req("b", "graph", [same_size[1]])])[0]
    assert engine.cache.stats.hits == hits and second.traces != first.traces
    engine.cache.clear()
    both = engine.decide([_req("a", "graph", [same_size[0]]), _req("b", "graph", [same_size[1]])])
    assert both[0].traces == first.traces and both[1].traces == second.traces


def test_image_order_matters(engine: Engine, pictures: list[bytes]) -> None:
    ab = engine.decide([_req("a", "two panels", [pictures[0], pictures[1]])])[0]
    ba = engine.decide([_req("a", "two panels", [pictures[1], pictures[0]])])[0]
    assert ab.traces != ba.traces


def test_model_digest_names_the_projector(engine: Engine, tmp_path: Path) -> None:
    text_only = file_digest(Path(engine.vision.source).parent / "tiny-Q8_0.gguf")
    assert engine.model_digest != text_only


def test_thoughts_about_an_image_have_the_same_bits_in_both_modes(
    engine: Engine, pictures: list[bytes]
) -> None:
    """AutoThink after image evidence: the thought continues at the evidence's rope positions
    (which run short of its token count), in the forest and in one-segment mode alike."""
    body = {"state": "dashboard: checkout p99", "questions": QUESTIONS, "images": [b64(pictures[1])]}
    thinking = DecideRequest("t", SystemOneRequest.model_validate(body), gate=1.0, thought_budget=3)
    engine.cache.clear()
    (forest,) = engine.decide([thinking])
    (alone,) = engine.decide([thinking], mode="per_question")
    assert forest.traces["down"].thought_tokens > 0 and forest.traces["down"].second is not None
    assert forest.traces == alone.traces


def test_tower_bits_do_not_depend_on_the_thread_count(engine: Engine, pictures: list[bytes]) -> None:
    """The tower gives the same bits whatever the process's intra-op thread count (a restart with
    another thread count decides the same): on the CPU it runs its ops on one thread itself."""
    image = prepare_image(pictures[0], engine.vision.config)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = encode_image(engine.vision, image)
        torch.set_num_threads(2)
        two = encode_image(engine.vision, image)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_two_ranks_decide_images_with_the_bits_of_one(engine: Engine, pictures: list[bytes]) -> None:
    """Tensor parallelism (two gloo ranks): every rank finds the projector beside the model, runs the
    tower whole and places the same embeddings; the integer partial sums give one rank's bits."""
    requests = [_req("t", "dashboard: checkout p99", [pictures[0]]), _req("u", "two panels", pictures[1:])]
    engine.cache.clear()
    expected = [r.traces for r in engine.decide(requests)]
    model = Path(engine.vision.source).parent / "tiny-Q8_0.gguf"
    two = Engine.load(model, precision="int8", decision_config=DecisionConfig(gate=0.0), tp=2)
    try:
        assert two.vision is not None and two.tp is not None and two.tp.world == 2
        assert two.model_digest == engine.model_digest
        assert [r.traces for r in two.decide(requests)] == expected
    finally:
        two.close()
    assert not dist.is_initialized()
