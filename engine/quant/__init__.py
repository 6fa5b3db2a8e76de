"""Quantization: the int8 precision path's weights and arithmetic (W8A8 with SmoothQuant).

- `linear`: `QuantLinear` (int8 rows per output channel) and the row-local int8 matmul whose
  bits never depend on how many rows share a call.
- `calibration`: startup requantization of a loaded model (measure activations on the
  calibration prompts, smooth, quantize) and its `QuantReport`.

May import: `engine.model`, `engine.kernels`; `calibration` also runs the fp32 level executor
(`engine.run.executor`, `engine.run.forest`) to measure activations, the one edge from this
floor up to `engine.run`.
"""
