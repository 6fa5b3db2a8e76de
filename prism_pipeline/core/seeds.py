"""Which seed a decision uses.

The seed only matters for AutoThink thought sampling, but it is part of every record, so it
must be reproducible from the event alone. Policies:
- `event` (default): the event's own `seed` when it has one, else one derived from its event id;
- `id`: always derived from the event id (ignores the event's seed);
- `fixed`: one configured seed for every event.

Derivation: the first 8 bytes of SHA-256("prism-seed-v1\\0" + event id as UTF-8), big-endian,
top bit cleared (a non-negative 63-bit integer, so it survives any signed-int64 consumer).
The version tag is part of the hash so a future derivation can never collide with this one.
"""

from __future__ import annotations

import hashlib
from typing import Literal

SeedPolicy = Literal["event", "id", "fixed"]
SEED_DERIVATION = "sha256-v1"


def derive_seed(event_id: str) -> int:
    digest = hashlib.sha256(b"prism-seed-v1\0" + event_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def choose_seed(policy: SeedPolicy, event_id: str, event_seed: int | None, fixed_seed: int = 0) -> int:
    if policy == "event":
        return event_seed if event_seed is not None else derive_seed(event_id)
    if policy == "id":
        return derive_seed(event_id)
    if policy == "fixed":
        return fixed_seed
    raise ValueError(f"unknown seed policy {policy!r} (expected event, id or fixed)")
