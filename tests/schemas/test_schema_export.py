"""The committed JSON Schema files match the models, and the exporter's --check notices drift."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson

from schemas import export

REPO = Path(__file__).resolve().parents[2]


def test_committed_schemas_are_current(tmp_path: Path) -> None:
    assert export.main(["--out", str(tmp_path)]) == 0
    fresh = {p.name: p.read_text("utf-8") for p in tmp_path.glob("*.schema.json")}
    committed = {p.name: p.read_text("utf-8") for p in export.JSON_DIR.glob("*.schema.json")}
    assert set(fresh) == {f"{n}.schema.json" for n in export.SCHEMAS}
    assert committed == fresh, "schemas/json is stale: run `python -m schemas.export`"


def test_check_flags_stale_missing_and_extra_files(tmp_path: Path) -> None:
    export.write(tmp_path)
    assert export.stale(tmp_path) == []
    (tmp_path / "dead_letter.schema.json").write_text("{}\n", "utf-8")
    (tmp_path / "decision_record.schema.json").unlink()
    (tmp_path / "old_thing.schema.json").write_text("{}\n", "utf-8")
    assert export.stale(tmp_path) == [
        "dead_letter.schema.json",
        "decision_record.schema.json",
        "old_thing.schema.json",
    ]
    assert export.main(["--check", "--out", str(tmp_path)]) == 1
    export.write(tmp_path)  # rewriting repairs everything, including removing the stray file
    assert export.main(["--check", "--out", str(tmp_path)]) == 0


def test_module_entry_point_checks_the_repo() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "schemas.export", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_schema_files_are_stable_json() -> None:
    for path in export.JSON_DIR.glob("*.schema.json"):
        text = path.read_text("utf-8")
        doc = json.loads(text)
        assert text == json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        assert doc["$schema"].endswith("2020-12/schema")


def test_event_schema_describes_the_contract() -> None:
    doc = orjson.loads((export.JSON_DIR / "evidence_event.schema.json").read_bytes())
    assert set(doc["required"]) == {"event_id", "source", "tenant", "created_at", "request"}
    assert doc["properties"]["source"]["enum"] == ["ticket", "alert", "other"]
    assert doc["additionalProperties"] is False
    question = doc["$defs"]["Question"]
    assert question["properties"]["type"]["enum"] == ["noul", "choice", "score"]
    shapes = question["properties"]["criteria"]["anyOf"]
    assert {"type": "null"} in shapes and any(s.get("maxProperties") == 255 for s in shapes)
