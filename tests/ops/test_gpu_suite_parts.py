"""ops/device/gpu_suite.sh names its kernel test files in parts; every kernel test file is in one.

The script refuses to start when a kernel test file is in no part (a renamed or new file must not
drop out of the GPU run), but it finds that out only on the GPU machine, after the machine's start
and the wheels' install: session 23 spent a device call learning that tests/engine/kernels/
test_attached.py was in no part. This test finds it on the CPU, from the script's own lists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops" / "device" / "gpu_suite.sh"
KERNEL_TESTS = Path("tests/engine/kernels")


def _part(name: str) -> list[str]:
    """The files of `NAME="..."` in the script, with `$K` spelled out."""
    match = re.search(rf'^{name}="([^"]*)"$', SCRIPT.read_text(), re.MULTILINE)
    assert match, f"{name} is not assigned in {SCRIPT}"
    return match.group(1).replace("$K", str(KERNEL_TESTS)).split()


def test_every_kernel_test_file_is_in_exactly_one_part() -> None:
    parts = _part("KERNELS_1") + _part("KERNELS_2")
    on_disk = sorted(str(p.relative_to(ROOT)) for p in (ROOT / KERNEL_TESTS).glob("test_*.py"))
    assert on_disk, "no kernel test files found"
    assert sorted(set(parts)) == on_disk, "gpu_suite.sh's parts and the kernel test files differ"
    assert len(parts) == len(set(parts)), "a kernel test file is named in two parts"


def test_every_other_part_path_exists() -> None:
    for path in _part("REST"):
        assert (ROOT / path).exists(), path
