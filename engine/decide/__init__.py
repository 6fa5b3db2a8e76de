"""The decision: from next-token logits to answers, and the thought draws between read-outs.

- `readout`: letter logits -> probabilities and vocabulary coverage; choice rounds over more
  than 26 options; mixing the first and second read-outs.
- `answers`: probabilities -> the typed answer (yes/no, choice, score) with its confidence rule.
- `sampling`: the counter-keyed uniforms and the batched top-k/top-p sampler for thoughts.
- `decision_config`: the operator's decision settings file (gate, temperatures, budgets).

May import: `engine.kernels` (the device coverage sums) and nothing else of `engine`: these
are pure functions of tensors and settings, tested without a model.
"""
