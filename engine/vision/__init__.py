"""Images in evidence: the Qwen3.5 vision tower read from llama.cpp's mmproj GGUF.

- `engine.vision.mmproj`: the projector file (`clip` architecture, projector `qwen3vl_merger`):
  its config and weights, and where to find it next to a text model.
- `engine.vision.preprocess`: untrusted image bytes -> checked, decoded, resized, normalized
  patches, as transformers' Qwen2-VL image processor (the one Qwen3.5 ships) computes them.
- `engine.vision.tower`: patches -> image embeddings in the text model's hidden size
  (patch embedding, blocks with 2-D rotary positions, patch merger).
- `engine.vision.placement`: where image tokens sit in the evidence segment and the text
  model's three-axis (MRoPE) positions for them.
- `engine.vision.evidence`: a request's images inside one decide call (checked once, encoded
  only when the evidence is really computed: a prefix-cache hit skips the tower).

The hooks outside this package are small: `Segment.images` / `SegmentState.shift` (engine.run.forest),
the executor placing embeddings and three-axis positions, and `Engine` checking images, keying the
cache on their digests and pre-running image evidence when forests run in one pass.
"""
