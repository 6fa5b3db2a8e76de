"""Images through the one-pass body (the CUDA int8 path): evidence holding images runs first through
the level executor, the questions hang from its state in the body. Bits are the same alone, in a
batch and from the cache, and the decisions agree with the level executor's. On CUDA the default
engine is used; on CPU the body is forced and its kernels run in Triton's interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.testing.images import b64, random_image
from engine.testing.make_model import DIMS, make_mmproj, make_model
from engine.types import DecideRequest
from schemas.systemone import SystemOneRequest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CACHE_BYTES = 1 << 26
QUESTIONS = {
    "down": {"type": "noul", "instructions": "Does the panel show an outage?"},
    "team": {"type": "choice", "criteria": {"dba": None, "sre": None, "net": None}},
}
pytestmark = pytest.mark.slow  # the Triton interpreter runs every kernel of every pass


def _req(event_id: str, state: str, images: list[bytes]) -> DecideRequest:
    body: dict = {"state": state, "questions": QUESTIONS}
    if images:
        body["images"] = [b64(d) for d in images]
    return DecideRequest(event_id, SystemOneRequest.model_validate(body), gate=0.0)


@pytest.fixture(scope="module")
def model(module_tmp_path: Path) -> Path:
    root = module_tmp_path
    make_mmproj(root / "mmproj-tiny.gguf", DIMS["tiny"], 0)
    return make_model(root / "tiny-Q8_0.gguf", "Q8_0", "tiny", 0, outliers=4)


def test_images_through_the_body(model: Path) -> None:
    body = None if DEVICE == "cuda" else True
    engine = Engine.load(model, device=DEVICE, precision="int8", cache_bytes=CACHE_BYTES, body=body)
    assert engine.body is not None and engine.vision is not None
    requests = [
        _req("a", "checkout p99 panel", [random_image(100, 160, seed=1)]),
        _req("c", "two panels", [random_image(64, 64, seed=2), random_image(80, 200, fmt="JPEG", seed=3)]),
    ]
    alone = []
    for r in requests:
        engine.cache.clear()
        alone.append(engine.decide([r])[0])
    engine.cache.clear()
    batch = engine.decide(requests)
    again = engine.decide(requests[::-1])[::-1]  # from the cache
    assert engine.cache.stats.hits >= len(requests)
    for b, a, s in zip(batch, again, alone, strict=True):
        assert b.error is None and b.traces == a.traces == s.traces

    levels = Engine.load(model, device=DEVICE, precision="int8", cache_bytes=0, body=False)
    for got, want in zip(batch, levels.decide(requests), strict=True):
        for qid in QUESTIONS:
            g, w = got.traces[qid].first.probabilities, want.traces[qid].first.probabilities
            assert g.index(max(g)) == w.index(max(w))
            assert max(abs(p - q) for p, q in zip(g, w, strict=True)) <= 1e-3
