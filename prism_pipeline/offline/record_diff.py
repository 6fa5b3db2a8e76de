"""Where two decision record encodings differ, field by field (`prism replay`'s report).

Floats are compared bit for bit (`-0.0 != 0.0`), key order counts (other order: other bytes), and
a difference that is only one of spelling (whitespace, number form) points at the first byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import orjson
import structlog

log = structlog.get_logger(__name__)


_ABSENT = object()


@dataclass(frozen=True)
class FieldDiff:
    path: str  # e.g. "questions.sev.first.probabilities[2]"; "" is the whole record
    recorded: Any
    replayed: Any

    def render(self) -> str:
        return f"{self.path or '<record>'}: recorded {_show(self.recorded)} | replayed {_show(self.replayed)}"


def _show(v: Any) -> str:
    if v is _ABSENT:
        return "<absent>"
    if isinstance(v, float):
        return f"{v!r} ({v.hex()})"
    text = orjson.dumps(v).decode() if not isinstance(v, str) or not v.startswith("<") else v
    return text if len(text) <= 160 else text[:159] + "…"


def _same_leaf(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):  # bit for bit: -0.0 != 0.0 here
        return struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def _walk(path: str, a: Any, b: Any, out: list[FieldDiff]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            _walk(f"{path}.{k}" if path else k, a.get(k, _ABSENT), b.get(k, _ABSENT), out)
        if [k for k in a if k in b] != [k for k in b if k in a]:  # same keys, other order: other bytes
            out.append(FieldDiff(f"{path}<key order>", list(a), list(b)))
        return
    if isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            _walk(f"{path}[{i}]", a[i] if i < len(a) else _ABSENT, b[i] if i < len(b) else _ABSENT, out)
        return
    if not _same_leaf(a, b):
        out.append(FieldDiff(path, a, b))


def record_diff(recorded: bytes, replayed: bytes) -> list[FieldDiff]:
    """Where two record encodings differ (empty: byte-identical)."""
    if recorded == replayed:
        return []
    try:
        a = orjson.loads(recorded)
    except orjson.JSONDecodeError as e:
        return [FieldDiff("", f"<not JSON: {e}>", "<a valid record>")]
    out: list[FieldDiff] = []
    _walk("", a, orjson.loads(replayed), out)
    if not out:  # equal values, different spelling (whitespace, number form): point at the bytes
        n = min(len(recorded), len(replayed))
        i = next((i for i in range(n) if recorded[i] != replayed[i]), n)
        out.append(FieldDiff(f"<bytes at {i}>", f"<{recorded[i : i + 40]!r}>", f"<{replayed[i : i + 40]!r}>"))
    return out
