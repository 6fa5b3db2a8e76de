"""`prism serve` answers a request with images end to end (a subprocess; the projector found beside
the model by llama.cpp's naming), and refuses hostile images with 422 `invalid_image` naming the
reason (truncated, a 30,000 x 30,000 header, a zip-bomb PNG) or 400 for wrong base64; the server
keeps serving after each."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from test_serve_cli import _start, _stop

from engine.testing.images import b64, huge_header_png, random_image, truncated, zip_bomb_png
from engine.testing.make_model import DIMS, make_mmproj, make_model
from engine.types import DecideRequest
from prism_pipeline.serve.requests import request_event_id
from schemas.systemone import SystemOneRequest

KEY = "vision-key"
QUESTIONS = {
    "down": {"type": "noul", "instructions": "Does the panel show an outage?"},
    "team": {"type": "choice", "criteria": {"dba": None, "sre": None}},
}


@pytest.fixture(scope="module")
def model_path(module_tmp_path: Path) -> Path:
    root = module_tmp_path
    path = make_model(root / "tiny-Q8_0.gguf", "Q8_0", "tiny")
    make_mmproj(root / "mmproj-tiny-F32.gguf", DIMS["tiny"], 0)
    (root / "decision_config.json").write_text(json.dumps({"thought_budget": 4}))
    return path


def test_prism_serve_answers_images_and_refuses_hostile_ones(model_path: Path) -> None:
    from engine.engine import Engine

    body = {
        "state": "checkout latency panel",
        "questions": QUESTIONS,
        "images": [b64(random_image(150, 220, seed=1)), b64(random_image(80, 80, fmt="JPEG", seed=2))],
    }
    proc, url = _start(model_path, api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        ok = httpx.post(f"{url}/v1/systemone", json=body, headers=auth, timeout=120)
        assert ok.status_code == 200, ok.text
        hostile = {
            "truncated": (b64(truncated(random_image(200, 200, seed=3))), "corrupt or truncated"),
            "header_30000": (b64(huge_header_png()), "too large to decode safely"),
            "zip_bomb": (b64(zip_bomb_png()), "more than the limit 40000000"),
        }
        for name, (image, reason) in hostile.items():
            r = httpx.post(f"{url}/v1/systemone", json={**body, "images": [image]}, headers=auth, timeout=60)
            assert r.status_code == 422, (name, r.text)
            detail = r.json()["detail"][0]
            assert detail["type"] == "invalid_image" and detail["loc"] == ["body", "images"], name
            assert reason in r.json()["error"], (name, r.text)
        r = httpx.post(f"{url}/v1/systemone", json={**body, "images": ["abc$"]}, headers=auth, timeout=60)
        assert r.status_code == 400 and r.json()["detail"][0]["type"] == "invalid_image"
        again = httpx.post(f"{url}/v1/systemone", json=body, headers=auth, timeout=120)
        assert again.status_code == 200 and again.json()["answers"] == ok.json()["answers"]
    finally:
        _stop(proc)

    # Oracle: the same files loaded here (the projector found the same way) decide the same answers.
    engine = Engine.load(model_path)
    assert engine.vision is not None
    request = SystemOneRequest.model_validate(body)
    (direct,) = engine.decide([DecideRequest(request_event_id(request), request, seed=0, gate=0.0)])
    answers = ok.json()["answers"]
    assert answers["down"]["noul"] == direct.answers["down"].noul
    assert answers["team"]["probabilities"] == direct.answers["team"].probabilities
    text_only = SystemOneRequest.model_validate({**body, "images": None})
    (blind,) = engine.decide([DecideRequest(request_event_id(text_only), text_only, seed=0, gate=0.0)])
    assert blind.answers["down"].noul != answers["down"]["noul"]  # the images were seen
