"""The demo model's training is deterministic: two short runs write identical bytes, which the
engine loads and answers with."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipeline.kafkautil import REPO

pytest.importorskip("transformers")


def _start(out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ops.train.train_demo_model", "--tiny", "--out", str(out),
         "--events", "12", "--steps", "3", "--batch", "2", "--threads", "1"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


def test_two_short_runs_give_identical_bytes(tmp_path: Path) -> None:
    # two independent processes (side by side: the suite's 2 cores), the same command
    runs = [(_start(tmp_path / f"{n}.gguf"), tmp_path / f"{n}.gguf") for n in ("a", "b")]
    for proc, _ in runs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    a, b = (path.read_bytes() for _, path in runs)
    assert hashlib.sha256(a).hexdigest() == hashlib.sha256(b).hexdigest()

    from engine.engine import Engine
    from engine.types import DecideRequest
    from prism_pipeline import synth
    from schemas.systemone import SystemOneRequest

    engine = Engine.load(tmp_path / "a.gguf", precision="fp32")
    event = next(synth.generate(1, seed=9, split="t"))
    (res,) = engine.decide([DecideRequest("e", SystemOneRequest.model_validate(event["request"]), gate=0.0)])
    assert res.error is None and set(res.answers) == set(event["labels"])


def test_bad_arguments_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ops.train.train_demo_model", "--out", "x.gguf", "--steps", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "steps" in done.stderr


def test_demo_rebuilds_a_missing_model_with_the_recipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The recipe's runs chained as `prism demo` chains them (here two short tiny runs).
    import ops.train.train_demo_model as train
    from prism_pipeline import demo

    short = ("--tiny", "--events", "12", "--steps", "2", "--batch", "2")
    monkeypatch.setattr(
        train, "RECIPE", (("--out", "{next}", *short), ("--out", "{next}", "--init", "{prev}", *short))
    )
    monkeypatch.setattr(demo, "bundled_model_path", lambda: tmp_path / "absent.gguf")
    path = demo.demo_model(tmp_path / "cache")
    assert path == tmp_path / "cache" / "models" / demo.DEMO_MODEL_FILE and path.is_file()
    assert (path.parent / (path.stem + ".stage1")).is_file()  # the first run's output fed the second
    assert demo.demo_model(tmp_path / "cache") == path  # made once, then reused


def test_the_prefix_tree_forward_equals_the_plain_forward_of_each_row() -> None:
    # The training runs each shared prefix once (ops/train/tree.py); every counted position must
    # see what the plain HF forward of its full row computes (padded rows of unequal lengths).
    from dataclasses import replace

    import torch
    from transformers import Qwen3_5ForCausalLM

    from engine.testing.hf import to_hf_config
    from ops.train.train_demo_model import Example, _tree, tiny_config
    from ops.train.tree import tree_forward

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(to_hf_config(replace(tiny_config(), vocab_size=40))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)

    def seq(n: int) -> list[int]:
        return torch.randint(0, 40, (n,), generator=g).tolist()

    rows = []
    for head in (seq(21), seq(34)):
        for stem in (seq(9), seq(17)):
            for tail in (seq(3), seq(12)):
                tokens = head + stem + tail
                targets = [
                    (p, 0, 0) for p in (len(head) - 1, len(head) + 4, len(tokens) - 2, len(tokens) - 1)
                ]
                rows.append(Example(tokens, targets, (len(head), len(head) + len(stem))))
    stages, st, node, pos, _, _ = _tree(rows, torch.arange(40))
    assert [len(s.ids) for s in stages] == [2, 4, 8]  # heads and stems once
    with torch.no_grad():
        outs = tree_forward(model, stages)
        k = 0
        for r in rows:
            ref = model.model(input_ids=torch.tensor([r.tokens])).last_hidden_state[0]
            for p, _, _ in r.targets:
                torch.testing.assert_close(outs[int(st[k])][node[k], pos[k]], ref[p], atol=1e-4, rtol=1e-4)
                k += 1
