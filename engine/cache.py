"""Cross-request prefix cache: evidence states keyed by their exact token prefix.

An entry is the `SegmentState` left by an evidence segment: per GDN layer the recurrent state
and conv tail at the segment's end, per attention layer the segment's own K/V (its ancestors,
i.e. the system root, stay with the engine). The key is a digest of the exact token prefix up
to the segment end plus the digests of the images in it, so only identical evidence hits:
one changed token or image is a different key.

Bounded by a byte budget with least-recently-used eviction. Entries pinned by a running batch
are never evicted; an entry that cannot fit without evicting pinned ones is not stored, so the
cache never holds more than its budget.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import structlog
import torch

from engine.run.forest import SegmentState

log = structlog.get_logger(__name__)

DEFAULT_FRACTION = 0.2  # of free device (or host) memory, when no budget is given


def prefix_key(tokens: Sequence[int], image_digests: Iterable[str] = ()) -> str:
    """Digest of an exact token prefix and the images inside it (order matters)."""
    h = hashlib.sha256()
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
    for digest in image_digests:
        h.update(b"\x00image:" + digest.encode())
    return h.hexdigest()


def default_budget(device: torch.device) -> int:
    """A fraction of the memory free right now on `device` (host RAM for the CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_FRACTION)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return int(info.get("MemAvailable", 1 << 30) * DEFAULT_FRACTION)
    except OSError:
        return 1 << 28


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0  # entries that did not fit the budget
    bytes: int = 0
    entries: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self._entries: OrderedDict[str, tuple[SegmentState, int]] = OrderedDict()
        self._pins: dict[str, int] = {}
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def lru_keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def get(self, key: str) -> SegmentState | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry[0]

    def put(self, key: str, state: SegmentState) -> bool:
        """Store (or refresh) an entry; returns False when it cannot fit the budget."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        size = state.nbytes()
        if size > self.budget:
            self.stats.rejected += 1
            return False
        for victim in [k for k in self._entries if not self._pins.get(k)]:
            if self.stats.bytes + size <= self.budget:
                break
            self._evict(victim)
        if self.stats.bytes + size > self.budget:
            self.stats.rejected += 1
            return False
        self._entries[key] = (state, size)
        self.stats.bytes += size
        self.stats.entries = len(self._entries)
        return True

    def pin(self, key: str) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        count = self._pins.get(key, 0) - 1
        if count > 0:
            self._pins[key] = count
        else:
            self._pins.pop(key, None)

    def pinned(self, key: str) -> bool:
        return bool(self._pins.get(key))

    def clear(self) -> None:
        for key in [k for k in self._entries if not self._pins.get(k)]:
            self._evict(key, count=False)

    def _evict(self, key: str, *, count: bool = True) -> None:
        _, size = self._entries.pop(key)
        self.stats.bytes -= size
        self.stats.entries = len(self._entries)
        if count:
            self.stats.evictions += 1
        log.debug("prefix_cache_evicted", key=key[:16], bytes=size)
