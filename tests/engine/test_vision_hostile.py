"""Hostile images get a clear error, never a crash, and never cost a decode they do not deserve:
a truncated file, a 30,000 x 30,000 header, a zip-bomb PNG, wrong base64, other formats. In a
batch, a bad image rejects its own request only; the others keep their bits."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image, ImageFile
from pydantic import ValidationError

from engine.decide.decision_config import DecisionConfig
from engine.engine import Engine
from engine.testing.images import b64, huge_header_png, random_image, truncated, zip_bomb_png
from engine.testing.make_model import DIMS, make_mmproj, make_model
from engine.types import DecideRequest
from engine.vision.preprocess import ImageError, ImageLimits, open_image
from schemas.deadletter import InvalidEvent, ReasonCode, parse_event
from schemas.systemone import SystemOneRequest

QUESTIONS = {"q": {"type": "noul", "instructions": "Is the service down?"}}


@pytest.fixture(scope="module")
def engine(module_tmp_path: Path) -> Engine:
    root = module_tmp_path
    model = make_model(root / "tiny.gguf", "F32", "tiny", 0)
    make_mmproj(root / "mmproj-tiny.gguf", DIMS["tiny"], 0)
    return Engine.load(model, precision="fp32", decision_config=DecisionConfig(gate=0.0))


def _request(*images: bytes) -> SystemOneRequest:
    return SystemOneRequest.model_validate(
        {"state": "s", "questions": QUESTIONS, "images": [b64(d) for d in images]}
    )


def _gif() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="GIF")
    return out.getvalue()


HOSTILE = {
    "truncated_png": (lambda: truncated(random_image(200, 200, seed=1)), "corrupt or truncated"),
    "truncated_jpeg": (
        lambda: truncated(random_image(200, 200, fmt="JPEG", seed=1), 0.4),
        "corrupt or truncated",
    ),
    "truncated_webp": (lambda: truncated(random_image(200, 200, fmt="WEBP", seed=1)), "corrupt or truncated"),
    "header_30000x30000": (huge_header_png, "too large to decode safely"),
    "zip_bomb_png": (zip_bomb_png, "7000x7000 = 49000000 pixels, more than the limit 40000000"),
    "gif": (_gif, "not a PNG/JPEG/WEBP image"),
    "garbage": (lambda: b"\x00\x01 not an image at all" * 10, "not a PNG/JPEG/WEBP image"),
    "aspect_1x300": (lambda: random_image(1, 300), "aspect ratio 300.0 is above 200"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_image_is_a_clear_error(engine: Engine, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    make, message = HOSTILE[name]
    data = make()
    assert len(data) < 1 << 20  # each is small on the wire: the danger is in what it claims
    request = _request(random_image(50, 50, seed=9), data)  # the bad one is the second image
    # Every pixel decode of a PNG/JPEG/WEBP goes through ImageFile.load (WEBP's own load ends in
    # it): the sizes it was asked to decode, not the CPU time it took, say what was decoded.
    decoded: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def load(img: ImageFile.ImageFile):  # noqa: ANN202
        decoded.append(img.size)
        return real_load(img)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    with pytest.raises(ImageError, match="image 1: ") as info:
        engine.count_tokens(request)
    assert message in str(info.value)
    (result,) = engine.decide([DecideRequest("e", request)])
    assert result.error is not None and result.error.startswith("invalid_image: image 1: ")
    assert message in result.error and result.answers == {}
    # refused from the header: no 30,000^2 (or 7,000^2) image was ever decoded
    limit = ImageLimits().max_source_pixels
    assert all(w * h <= limit for w, h in decoded), decoded


def test_open_image_bounds_bytes_and_pixels() -> None:
    data = random_image(100, 100, seed=2)
    with pytest.raises(ImageError, match="bytes, more than the limit 100"):
        open_image(data, ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match="100x100 = 10000 pixels, more than the limit 9999"):
        open_image(data, ImageLimits(max_source_pixels=9999))
    with pytest.raises(ImageError, match="empty"):
        open_image(b"")
    assert open_image(data).size == (100, 100)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not base64!!", "not valid base64"),
        ("abcde", "not a multiple of 4"),
        ("abc$", "not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "is not an image type"),
        ("", "empty"),
    ],
)
def test_wrong_base64_is_invalid_image(value: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        SystemOneRequest.model_validate({"state": "s", "questions": QUESTIONS, "images": [value]})
    event = {
        "event_id": "e1",
        "source": "alert",
        "tenant": "t",
        "created_at": "2026-12-01T00:00:00Z",
        "request": {"state": "s", "questions": QUESTIONS, "images": [value]},
    }
    raw = json.dumps(event).encode()
    with pytest.raises(InvalidEvent) as info:
        parse_event(raw)
    assert info.value.reason == ReasonCode.invalid_image


def test_a_bad_image_rejects_only_its_request(engine: Engine) -> None:
    good = DecideRequest("g", _request(random_image(80, 120, seed=4)))
    bad = DecideRequest("b", _request(truncated(random_image(80, 120, seed=5))))
    (alone,) = engine.decide([good])
    mixed = engine.decide([bad, good, bad])
    assert mixed[0].error is not None and mixed[2].error is not None
    assert mixed[1].error is None and mixed[1].traces == alone.traces


def test_backfill_dead_letters_a_hostile_image(engine: Engine) -> None:
    from prism_pipeline.offline.backfill import BackfillOptions, decide_chunk
    from prism_pipeline.offline.sources import Item
    from schemas.codec import loads
    from schemas.deadletter import DeadLetter

    def raw(event_id: str, image: bytes) -> bytes:
        return json.dumps(
            {
                "event_id": event_id,
                "source": "alert",
                "tenant": "t",
                "created_at": "2026-12-01T00:00:00Z",
                "request": {"state": "s", "questions": QUESTIONS, "images": [b64(image)]},
            }
        ).encode()

    items = [
        Item(raw("good", random_image(60, 60, seed=1)), "f", 0, 0),
        Item(raw("bomb", zip_bomb_png()), "f", 0, 1),
    ]
    out = decide_chunk(engine, items, BackfillOptions())
    assert [r.event_id for r in out.records] == ["good"]
    (letter,) = [loads(d, DeadLetter) for d in out.dead]
    assert letter.reason == ReasonCode.invalid_image and "more than the limit" in letter.message
    assert out.reasons == {"invalid_image": 1}
