"""The engine's records keep their exact bits across refactors (issue #26: the engine's house).

`data/bits_before.json` holds the records of `bits_cases.requests()` captured before the modules
moved (commit named in the capture's git history); every number is compared as `float.hex`. The
comparison only holds under the torch build and CPU instruction set of the capture: fp32 CPU
kernels may round differently on another ISA, so elsewhere the test skips and says why.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bits_cases import DATA, MODEL, decide_all, interpreted, platform


@pytest.fixture(scope="module")
def captured() -> dict[str, Any]:
    data = json.loads(DATA.read_text())
    here = platform()
    then = {"torch": data["torch"], "cpu_capability": data["cpu_capability"]}
    if here != then:
        pytest.skip(f"bits captured under {then}, this run has {here}: rounding may differ per ISA/build")
    assert data["model"] == MODEL
    return data["records"]


@pytest.fixture(scope="module")
def decided(captured: dict[str, Any], gguf_model: Callable[..., Path]) -> dict[str, Any]:
    m = MODEL
    return decide_all(gguf_model(m["quant"], m["dims"], m["seed"], m["mtp"], m["outliers"]))


@pytest.mark.parametrize("path", ["int8", "fp32", "int8_body", "int8_decoder"])
def test_records_bit_identical_to_the_capture(
    path: str, captured: dict[str, Any], decided: dict[str, Any]
) -> None:
    if path not in decided:
        assert not interpreted()
        pytest.skip("the body and decoder run on CPU only under Triton's interpreter (no CUDA here)")
    assert set(decided[path]) == set(captured[path])
    for name, record in captured[path].items():
        assert decided[path][name] == record, (path, name)
