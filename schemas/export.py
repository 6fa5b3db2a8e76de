"""Write the JSON Schema files of the wire contract: `python -m schemas.export [--check] [--out DIR]`.

The files in schemas/json/ are generated and committed; `--check` exits 1 when they are stale (CI runs
it through tests/schemas). Formatting is stable: sorted keys, 2-space indent, trailing newline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import structlog
from pydantic import BaseModel

from schemas.deadletter import DeadLetter
from schemas.event import EvidenceEvent
from schemas.record import DecisionRecord
from schemas.systemone import SystemOneRequest, SystemOneResponse

log = structlog.get_logger(__name__)

JSON_DIR = Path(__file__).parent / "json"
DRAFT = "https://json-schema.org/draft/2020-12/schema"
SCHEMAS: dict[str, type[BaseModel]] = {
    "evidence_event": EvidenceEvent,
    "decision_record": DecisionRecord,
    "dead_letter": DeadLetter,
    "systemone_request": SystemOneRequest,
    "systemone_response": SystemOneResponse,
}


def render() -> dict[str, str]:
    """File name -> file text for every schema."""
    out = {}
    for name, model in SCHEMAS.items():
        schema = {
            "$schema": DRAFT,
            "$id": f"{name}.schema.json",
            **model.model_json_schema(mode="validation"),
        }
        out[f"{name}.schema.json"] = json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return out


def stale(directory: Path = JSON_DIR) -> list[str]:
    """Names of schema files in `directory` that are missing, different, or not generated any more."""
    expected = render()
    present = {p.name for p in directory.glob("*.schema.json")} if directory.is_dir() else set()
    bad = [
        n for n, text in expected.items() if n not in present or (directory / n).read_text("utf-8") != text
    ]
    return sorted(bad + sorted(present - set(expected)))


def write(directory: Path = JSON_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    expected = render()
    for old in directory.glob("*.schema.json"):
        if old.name not in expected:
            old.unlink()
    paths = []
    for name, text in expected.items():
        path = directory / name
        path.write_text(text, "utf-8")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m schemas.export", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the files differ from the models")
    parser.add_argument("--out", type=Path, default=JSON_DIR, help="directory (default: schemas/json)")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(args.out)
        if bad:
            sys.stderr.write(
                f"stale JSON schemas in {args.out}: {', '.join(bad)}; run python -m schemas.export\n"
            )
            return 1
        return 0
    paths = write(args.out)
    log.info("schemas_written", directory=str(args.out), files=[p.name for p in paths])
    return 0


if __name__ == "__main__":
    sys.exit(main())
