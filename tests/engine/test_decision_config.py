"""decision_config.json: defaults, strict keys, discovery beside the model, stable digest."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from engine.decide.decision_config import (
    FILE_NAME,
    DecisionConfig,
    DecisionConfigError,
    Temperatures,
    find_decision_config,
    load_decision_config,
)


def write(path, data) -> str:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
    return str(path)


def test_defaults():
    c = load_decision_config(None)
    assert c == DecisionConfig()
    assert (c.temperature("noul"), c.temperature("choice"), c.temperature("score")) == (1.0, 1.0, 1.0)
    assert (c.gate, c.thought_budget, c.second_weight) == (0.6, 4096, 1.0)
    assert (c.thought_temperature, c.thought_top_p, c.thought_top_k) == (0.6, 0.95, 20)
    assert c.coverage is True and c.confidence == "startlux"


def test_partial_file_takes_defaults_for_missing_keys(tmp_path):
    c = load_decision_config(write(tmp_path / "dc.json", {"temperatures": {"choice": 1.3}, "gate": 0.9}))
    assert c.temperature("choice") == 1.3 and c.temperature("noul") == 1.0
    assert c.gate == 0.9 and c.thought_budget == 4096


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gate": 0.5, "mixing": 0.3, "zeta": 1}, "unknown key\\(s\\) 'mixing', 'zeta'"),
        ({"temperatures": {"yesno": 1.0}}, "unknown temperature key\\(s\\) 'yesno'"),
        ({"temperatures": [1.0]}, "temperatures must be an object"),
        ({"temperatures": {"score": 0}}, "temperatures.score must be > 0"),
        ({"gate": 1.5}, "gate must be in \\[0, 1\\]"),
        ({"gate": True}, "gate must be a number"),
        ({"gate": "0.6"}, "gate must be a number"),
        ({"thought_budget": 0}, "thought_budget must be >= 1"),
        ({"thought_budget": 10.0}, "thought_budget must be an integer"),
        ({"second_weight": -0.1}, "second_weight"),
        ({"thought_top_p": 0.0}, "thought_top_p"),
        ({"thought_top_k": -1}, "thought_top_k"),
        ({"thought_temperature": 0}, "thought_temperature"),
        ({"coverage": 1}, "coverage must be true or false"),
        ({"confidence": "entropy"}, "confidence must be one of"),
        ([1, 2], "top level must be a JSON object"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, data, message):
    path = write(tmp_path / "dc.json", data)
    with pytest.raises(DecisionConfigError, match=message) as info:
        load_decision_config(path)
    assert path in str(info.value)
    assert isinstance(info.value, ValueError)


def test_non_finite_and_malformed_json(tmp_path):
    with pytest.raises(DecisionConfigError, match="gate must be finite"):
        load_decision_config(write(tmp_path / "a.json", '{"gate": NaN}'))
    with pytest.raises(DecisionConfigError, match="cannot read decision config"):
        load_decision_config(write(tmp_path / "b.json", '{"gate": '))
    with pytest.raises(DecisionConfigError, match="not found"):
        load_decision_config(tmp_path / "missing.json")


def test_found_beside_a_model_file_or_inside_a_model_dir(tmp_path):
    model = tmp_path / "StartLux-Decision-4B.Q8_0.gguf"
    model.write_bytes(b"GGUF")
    assert find_decision_config(model) is None
    assert load_decision_config(model) == DecisionConfig()  # none beside it: defaults
    write(tmp_path / FILE_NAME, {"temperatures": {"noul": 0.8}})
    assert find_decision_config(model) == tmp_path / FILE_NAME
    assert load_decision_config(model).temperature("noul") == 0.8
    assert load_decision_config(tmp_path).temperature("noul") == 0.8
    with pytest.raises(DecisionConfigError, match="model path not found"):
        load_decision_config(tmp_path / "nope.gguf")


def test_digest_is_sha256_of_canonical_json_and_ignores_spelling(tmp_path):
    a = DecisionConfig.from_dict({"gate": 1, "temperatures": {"score": 2, "noul": 1}})
    b = DecisionConfig.from_dict({"temperatures": {"noul": 1.0, "score": 2.0}, "gate": 1.0})
    assert a == b and a.digest() == b.digest()
    canonical = json.dumps(a.to_dict(), sort_keys=True, separators=(",", ":"))
    assert a.digest() == hashlib.sha256(canonical.encode()).hexdigest()
    assert DecisionConfig(gate=0.61).digest() != DecisionConfig().digest()
    assert DecisionConfig(temperatures=Temperatures(score=1.1)).digest() != DecisionConfig().digest()
    assert DecisionConfig.from_dict(json.loads(a.canonical_json())) == a  # round trip


def test_digest_is_stable_across_processes():
    code = "from engine.decide.decision_config import DecisionConfig; print(DecisionConfig().digest())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == DecisionConfig().digest()


def test_unknown_question_type():
    with pytest.raises(DecisionConfigError, match="unknown question type 'rank'"):
        DecisionConfig().temperature("rank")
