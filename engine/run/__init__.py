"""Execution: running the model over a forest of token segments, or one token per thought step.

- `forest`: segments (shared prefixes as a tree) packed into one batch, and their kept states.
- `executor`: the level-by-level forest executor, the CPU/fp32/bf16 path and the oracle the
  one-pass body is tested against.
- `body`: the one-pass forest body on device tables (the CUDA int8 path; CUDA graphs per bucket).
- `decoder`: one-token thought steps on device buffers (CUDA int8; graph-captured per bucket).
- `reference`: the plain per-sequence forward, the CPU oracle (kept independent of the others).
- `rope`, `elementwise`, `int8_rows`: the per-row pieces the paths share (RoPE tables,
  position-independent activations, row-local int8 blocks).
- `tp`: tensor parallelism (process group, sharding, collectives).

May import: `engine.model`, `engine.quant`, `engine.kernels`, `engine.vision.placement`.
Not `engine.decide` or the facade (`engine.engine`): execution knows nothing of questions.
"""
