"""The model file: what a StartLux-Decision GGUF holds, read into plain tensors and text tools.

- `config`: the qwen35 hyper-parameters (`ModelConfig`) every other part sizes itself by.
- `gguf`: the GGUF container (metadata, tensor directory) and its errors.
- `dequant`: GGML block formats (Q8_0, Q4_K, ...) -> float tensors.
- `loader`, `weights`: the file's tensors in the canonical (HF) layout, `Weights`.
- `tokenizer`, `prompt`: the file's byte-level BPE and the chat prompt Prism renders and
  tokenizes (system, evidence, question segments; letter tokens).

May import: nothing else of `engine` (it is the bottom floor; `engine.run`, `engine.quant`,
`engine.decide`, `engine.kernels` and `engine.vision` build on it).
"""
