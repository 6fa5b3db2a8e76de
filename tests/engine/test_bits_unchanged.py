"""The engine's records keep their exact bits across refactors (issue #26: the engine's house).

`data/bits_before*.json` hold the records of `bits_cases.requests()`, one file per platform they
were captured on (the first before the modules moved: commit named in its git history; others
added where a CPU rounds differently); every number is compared as `float.hex`. A capture counts
only under its torch build, CPU instruction set and fp32 kernel rounding digest
(`bits_cases.platform`; the first capture predates the digest, so it counts wherever the other
two match): fp32 CPU kernels may round differently elsewhere, and the test then skips and says
why. A path's records must equal those of one counting capture: a regression that lands exactly
on another CPU's bits is not a real risk, a CPU whose digest happens to match another's is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bits_cases import DATA, MODEL, decide_all, interpreted, platform


@pytest.fixture(scope="module")
def captured() -> list[dict[str, Any]]:
    here = platform()
    counting, seen = [], []
    for path in sorted(DATA.parent.glob("bits_before*.json")):
        data = json.loads(path.read_text())
        then = {k: data.get(k, here[k] if k == "kernel_rounding" else None) for k in here}
        seen.append(then)
        if then == here:
            assert data["model"] == MODEL
            counting.append(data["records"])
    if not counting:
        pytest.skip(f"bits captured under {seen}, this run has {here}: rounding may differ per CPU/build")
    return counting


@pytest.fixture(scope="module")
def decided(captured: list[dict[str, Any]], gguf_model: Callable[..., Path]) -> dict[str, Any]:
    m = MODEL
    return decide_all(gguf_model(m["quant"], m["dims"], m["seed"], m["mtp"], m["outliers"]))


@pytest.mark.parametrize("path", ["int8", "fp32", "int8_body", "int8_decoder"])
def test_records_bit_identical_to_the_capture(
    path: str, captured: list[dict[str, Any]], decided: dict[str, Any]
) -> None:
    if path not in decided:
        assert not interpreted()
        pytest.skip("the body and decoder run on CPU only under Triton's interpreter (no CUDA here)")
    if any(decided[path] == records[path] for records in captured):
        return
    records = captured[0]  # none equal: show the differences from the first
    assert set(decided[path]) == set(records[path])
    for name, record in records[path].items():
        assert decided[path][name] == record, (path, name)
