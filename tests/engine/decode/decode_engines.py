"""The decode tests' engines on other execution paths over one loaded engine's weights.

A module of its own (not conftest.py): test files import it by name, as the body tests import
`body_cases`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.engine import Engine


def same_weights(engine: Engine, **path: Any) -> Engine:
    """`engine`'s int8 weights, config and device on another execution path (`decoder=True`: the
    thoughts step on the decoder; `decoder_dots`: its attention dots), nothing quantized again."""
    from engine.engine import Engine

    p = engine.path
    choices = {"body": p.body, "decoder": p.decoder, "body_settings": p.body_settings} | path
    return Engine(
        weights=engine.weights,
        tokenizer=engine.tokenizer,
        decision_config=engine.decision_config,
        precision="int8",
        device=str(p.device),
        cache_bytes=0,
        **choices,
    )
