"""Offline jobs over fixed inputs: `prism backfill` and `prism replay` (and the demo's verify),
built from sources, sinks, a checkpoint and Kafka range reads."""
