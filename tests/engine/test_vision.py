"""Images in evidence (engine.vision) against transformers' Qwen3.5, the independent oracle.

- the mmproj file: written as llama.cpp's converter lays it out, read back to the same tensors;
- preprocessing: `prepare_image` equals `Qwen2VLImageProcessorPil` (Qwen3.5's processor) bit for
  bit on images of many sizes, modes and formats;
- the tower: equals `Qwen3_5VisionModel` on the same weights;
- the whole prompt: the engine's fp32 logits (image embeddings placed in the evidence segment,
  three-axis positions) equal `Qwen3_5ForConditionalGeneration`'s, built from the generator's
  canonical tensors (never from the files the engine reads), at every read position of prompts
  with one and with two images, in one segment and as a forest (evidence, then questions);
- the token layout equals the GGUF's own chat template with the images first in the user turn.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import jinja2
import jinja2.ext
import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from PIL import Image

from engine.decide.decision_config import DecisionConfig
from engine.engine import Engine
from engine.model.gguf import GGUFError
from engine.model.prompt import render_parts, render_parts_for_state_text, render_state
from engine.run.executor import run_forest
from engine.run.forest import Segment, build_forest
from engine.testing.hf import to_hf_vl_model
from engine.testing.images import b64, random_image
from engine.testing.make_model import (
    DIMS,
    canonical_random_weights,
    make_model,
    random_vision_weights,
    vision_config_for,
    write_mmproj,
)
from engine.testing.vocab import qwen35_vocab
from engine.types import DecideRequest
from engine.vision.evidence import ImageSet, VisionTokens
from engine.vision.mmproj import find_mmproj, load_mmproj
from engine.vision.placement import SegmentImages
from engine.vision.preprocess import ImageLimits, prepare_image
from engine.vision.tower import encode_image
from schemas.systemone import SystemOneRequest

transformers = pytest.importorskip("transformers")

MAX_REL_ERR = 1e-4
SEED = 0
VISION_IDS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}
# (height, width, format, mode): >= 20 images; sizes below min_pixels (upscaled), around it, odd
# sides, wide and tall aspect ratios, every decoder path (palette + tRNS, alpha, grey, JPEG, WebP).
IMAGES = [
    (1, 1, "PNG", "RGB"),
    (17, 23, "PNG", "RGB"),
    (31, 480, "PNG", "RGB"),
    (256, 256, "PNG", "RGB"),
    (255, 257, "PNG", "RGBA"),
    (300, 500, "PNG", "P"),
    (121, 99, "PNG", "L"),
    (64, 64, "PNG", "LA"),
    (500, 300, "JPEG", "RGB"),
    (333, 222, "JPEG", "L"),
    (96, 640, "JPEG", "RGB"),
    (240, 320, "WEBP", "RGB"),
    (200, 200, "WEBP", "RGBA"),
    (47, 530, "WEBP", "RGB"),
    (600, 40, "PNG", "RGB"),
    (270, 270, "PNG", "RGB"),
    (288, 352, "JPEG", "RGB"),
    (720, 540, "PNG", "RGB"),
    (100, 1000, "WEBP", "RGB"),
    (2, 300, "PNG", "RGB"),
    (480, 640, "JPEG", "RGB"),
    (411, 289, "PNG", "RGBA"),
]


@pytest.fixture(scope="module")
def vision_weights():
    return random_vision_weights(vision_config_for(DIMS["tiny"]), SEED)


@pytest.fixture(scope="module")
def hf_vl(vision_weights):
    return to_hf_vl_model(canonical_random_weights(DIMS["tiny"], SEED), vision_weights, VISION_IDS)


@pytest.fixture(scope="module")
def model_dir(module_tmp_path: Path, vision_weights) -> Path:
    """A tiny F32 model with its projector beside it, named as llama.cpp names them."""
    root = module_tmp_path
    make_model(root / "tiny-F32.gguf", "F32", "tiny", SEED)
    write_mmproj(root / "mmproj-tiny-F32.gguf", vision_weights)
    return root


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine.load(
        model_dir / "tiny-F32.gguf", precision="fp32", decision_config=DecisionConfig(gate=0.0)
    )


def hf_processor(config, max_pixels: int | None = None):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=config.patch_size,
        merge_size=config.spatial_merge_size,
        temporal_patch_size=config.temporal_patch_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
        size={"shortest_edge": config.min_pixels, "longest_edge": max_pixels or config.max_pixels},
    )


# ------------------------------------------------------------------------------------- the file
@pytest.mark.parametrize("quant", ["F32", "F16"])
def test_mmproj_round_trip(tmp_path: Path, vision_weights, quant: str) -> None:
    path = write_mmproj(tmp_path / "mmproj-x.gguf", vision_weights, quant)
    back = load_mmproj(path)
    assert back.config == vision_weights.config

    def stored(t: torch.Tensor) -> torch.Tensor:  # what the file holds: >= 2-D weights in F16
        return t.half().float() if quant == "F16" and t.dim() >= 2 else t

    assert torch.equal(back.patch_embd, stored(vision_weights.patch_embd))
    assert torch.equal(back.pos_embd, stored(vision_weights.pos_embd))
    assert torch.equal(back.mm2_w, stored(vision_weights.mm2_w))
    for ours, theirs in zip(back.blocks, vision_weights.blocks, strict=True):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], stored(theirs[k])) for k in ours)


def test_mmproj_found_by_llama_cpp_naming(tmp_path: Path) -> None:
    model = tmp_path / "StartLux-4B-Q8_0.gguf"
    model.touch()
    assert find_mmproj(model) is None
    (tmp_path / "mmproj-StartLux-4B-F16.gguf").touch()
    assert find_mmproj(model) == tmp_path / "mmproj-StartLux-4B-F16.gguf"
    (tmp_path / "mmproj-other-F16.gguf").touch()  # two candidates: the one naming the model
    assert find_mmproj(model) == tmp_path / "mmproj-StartLux-4B-F16.gguf"


def test_text_model_is_not_a_projector(model_dir: Path) -> None:
    with pytest.raises(GGUFError, match="architecture 'qwen35', expected 'clip'"):
        load_mmproj(model_dir / "tiny-F32.gguf")


def test_projector_of_another_width_is_refused(tmp_path: Path, model_dir: Path) -> None:
    other = random_vision_weights(vision_config_for(DIMS["tiny"], out_hidden_size=48), SEED)
    path = write_mmproj(tmp_path / "mmproj-wrong.gguf", other)
    with pytest.raises(GGUFError, match="projects to 48 dims"):
        Engine.load(model_dir / "tiny-F32.gguf", precision="fp32", mmproj=path)
    # found beside a model (not named by the caller), another model's projector is passed over
    (tmp_path / "tiny.gguf").symlink_to(model_dir / "tiny-F32.gguf")
    assert find_mmproj(tmp_path / "tiny.gguf") == path
    assert Engine.load(tmp_path / "tiny.gguf", precision="fp32").vision is None


# ---------------------------------------------------------------------------- preprocessing
def test_preprocessing_equals_transformers_processor(vision_weights) -> None:
    config = vision_weights.config
    assert len(IMAGES) >= 20
    processors = {None: hf_processor(config), 200_000: hf_processor(config, 200_000)}
    formats = set()
    for i, (h, w, fmt, mode) in enumerate(IMAGES):
        data = random_image(h, w, fmt=fmt, mode=mode, seed=i)
        formats.add(Image.open(io.BytesIO(data)).format)
        for max_pixels, proc in processors.items():
            ours = prepare_image(data, config, max_pixels=max_pixels)
            ref = proc(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
            assert ref["image_grid_thw"].tolist() == [[1, ours.grid_h, ours.grid_w]], (h, w, fmt, mode)
            assert torch.equal(ours.pixels, ref["pixel_values"]), (h, w, fmt, mode, max_pixels)
    assert formats == {"PNG", "JPEG", "WEBP"}


# -------------------------------------------------------------------------------------- tower
def test_tower_equals_transformers(vision_weights, hf_vl) -> None:
    proc = hf_processor(vision_weights.config)
    for i, (h, w, fmt, mode) in enumerate(IMAGES[::4]):
        data = random_image(h, w, fmt=fmt, mode=mode, seed=100 + i)
        ours = encode_image(vision_weights, prepare_image(data, vision_weights.config))
        px = proc(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
        with torch.no_grad():
            ref = hf_vl.model.visual(px["pixel_values"], grid_thw=px["image_grid_thw"]).pooler_output
        assert ours.shape == ref.shape
        assert float((ours - ref).abs().max() / ref.abs().max()) <= MAX_REL_ERR


# ---------------------------------------------------------------------------- whole prompts
def _request(images: list[bytes], n_questions: int = 3) -> SystemOneRequest:
    questions = {
        "q0": {"type": "noul", "instructions": "Does the panel show an outage?"},
        "q1": {
            "type": "choice",
            "instructions": "Which service?",
            "criteria": {"api": None, "db": "database"},
        },
        "q2": {"type": "score", "criteria": ["none", "minor", "major"]},
    }
    return SystemOneRequest.model_validate(
        {
            "state": {"alert": "p99 latency over 2s", "host": "web-3"},
            "questions": dict(list(questions.items())[:n_questions]),
            "images": [b64(d) for d in images],
        }
    )


def _hf_logits(hf_vl, engine: Engine, tokens: list[int], images: list[bytes]) -> torch.Tensor:
    proc = hf_processor(engine.vision.config, engine.stages.max_image_pixels)
    px = proc(images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="pt")
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return hf_vl(
            input_ids=ids,
            pixel_values=px["pixel_values"],
            image_grid_thw=px["image_grid_thw"],
            mm_token_type_ids=(ids == VISION_IDS["image_token_id"]).int(),
            use_cache=False,
        ).logits[0]


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_with_images_equal_transformers(engine: Engine, hf_vl, n_images: int) -> None:
    images = [random_image(180, 260, seed=7), random_image(90, 500, fmt="JPEG", seed=8)][:n_images]
    request = _request(images)
    vt = VisionTokens.of(engine.tokenizer)
    image_set = engine.stages.image_set(request)
    assert len(image_set.grids) == n_images
    prefix = engine.prompts.prefix_ids
    evidence = image_set.tokens(vt) + engine.prompts.evidence_ids(render_state(request.state))
    questions = []
    for qid, question in request.questions.items():
        parts = render_parts_for_state_text("", question)
        questions.append((qid, engine.prompts.question_ids(parts.question_text)))
    checked = 0
    for _, q_tokens in questions:
        whole = prefix + evidence + q_tokens
        ref = _hf_logits(hf_vl, engine, whole, images)
        # one segment from the sequence start
        seg = Segment(tuple(whole), None, True, engine.stages.segment_images(whole, image_set))
        one = run_forest(engine.weights, build_forest([seg])).logits[0]
        assert _rel(one, ref[-1]) <= MAX_REL_ERR
        # the forest: the system root, the evidence (images inside) reading its last token, the question
        ev = Segment(tuple(evidence), engine.root, True, engine.stages.segment_images(evidence, image_set))
        out = run_forest(engine.weights, build_forest([ev, Segment(tuple(q_tokens), 0, True)]))
        assert _rel(out.logits[0], ref[len(prefix) + len(evidence) - 1]) <= MAX_REL_ERR
        assert _rel(out.logits[1], ref[-1]) <= MAX_REL_ERR
        checked += 3
        # the oracle is sensitive to what is checked: plain 1-D positions for the images are far off
        flat = SegmentImages(
            embeds=seg.images.embeds,
            index=seg.images.index,
            offsets=torch.arange(len(whole))[None, :].repeat(3, 1),
            span=len(whole),
            digests=seg.images.digests,
        )
        wrong = run_forest(engine.weights, build_forest([Segment(tuple(whole), None, True, flat)])).logits[0]
        assert _rel(wrong, ref[-1]) > 10 * MAX_REL_ERR
    assert checked == 9


def test_decide_forest_equals_per_question_with_images(engine: Engine) -> None:
    request = _request([random_image(120, 200, seed=3), random_image(300, 100, fmt="WEBP", seed=4)])
    forest = engine.decide([DecideRequest("a", request)])[0]
    alone = engine.decide([DecideRequest("a", request)], mode="per_question")[0]
    assert forest.error is None and alone.error is None
    for qid in request.questions:
        a, b = forest.traces[qid].first.probabilities, alone.traces[qid].first.probabilities
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_tokens_equal_chat_template_with_images(engine: Engine) -> None:
    vocab = qwen35_vocab()
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw)
    template = env.from_string(vocab.chat_template)
    request = _request([random_image(70, 90, seed=1), random_image(300, 40, seed=2)], n_questions=1)
    image_set = engine.stages.image_set(request)
    parts = render_parts(request.state, request.questions["q0"])
    content = [{"type": "image"} for _ in image_set.grids] + [{"type": "text", "text": parts.user}]
    text = template.render(
        messages=[{"role": "system", "content": parts.system}, {"role": "user", "content": content}],
        add_generation_prompt=True,
        enable_thinking=False,
    )
    # the processor repeats each image's pad token once per merged patch
    pad = "<|image_pad|>"
    pieces = text.split(pad)
    assert len(pieces) == len(image_set.grids) + 1
    expanded = pieces[0] + "".join(
        pad * (gh * gw) + piece for (gh, gw), piece in zip(image_set.grids, pieces[1:], strict=True)
    )
    vt = VisionTokens.of(engine.tokenizer)
    ours = (
        engine.prompts.prefix_ids
        + image_set.tokens(vt)
        + engine.prompts.evidence_ids(parts.state_text)
        + engine.prompts.question_ids(parts.question_text)
    )
    assert ours == engine.tokenizer.encode_with_specials(expanded)


def test_count_tokens_counts_image_tokens(engine: Engine) -> None:
    data = random_image(512, 384, seed=11)
    request = _request([data], n_questions=1)
    n_text = engine.count_tokens(_request([], n_questions=1).model_copy(update={"images": None}))
    grid = ImageSet.check(
        [data], engine.vision, ImageLimits(), engine.stages.max_image_pixels, engine.stages.grids
    ).grids[0]
    assert grid == (512 // 32, 384 // 32)  # (rows, columns) of merged 32-pixel squares
    assert engine.count_tokens(request) == n_text + grid[0] * grid[1] + 2


def test_images_without_projector_are_rejected(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tiny.gguf").symlink_to(model_dir / "tiny-F32.gguf")
    text_only = Engine.load(tmp_path / "tiny.gguf", precision="fp32")
    assert text_only.vision is None
    (result,) = text_only.decide([DecideRequest("a", _request([random_image(40, 40)], 1))])
    assert result.error is not None and "mmproj" in result.error
