"""The per-row tables the one-token decode kernels read (`engine.run.decoder` fills them).

A decode step runs B rows (a bucket; rows past the live ones are padding). Every row carries
one int64 record, `rows[b] = (token, thought_len, state_off, conv_off, live)`:

- token: the token id fed this step;
- thought_len: thought tokens already in the row's own K/V buffers (where this step's K/V go);
- state_off / conv_off: element offsets, relative to the step's `base` fp32 tensor, of the
  row's Gated DeltaNet state block [n_gdn, nv, dk, dv] and conv tail block [n_gdn, C, W-1];
- live: 0 for padding rows, which read nothing and write nothing.

Attention layers also get `pieces[b, p] = (k_off, v_off, length, rows_per_head)` for each of
P pieces, ancestors oldest first and the row's own thought buffer last (its length is
thought_len + 1 at run time, the current token included). Offsets are elements relative to
`base` too: kernels read `base + off`, so K/V are used where they lie, never gathered.
"""

from __future__ import annotations

import torch

TOKEN, THOUGHT_LEN, STATE_OFF, CONV_OFF, LIVE = range(5)
ROW_FIELDS = 5
K_OFF, V_OFF, LENGTH, HEAD_ROWS = range(4)
PIECE_FIELDS = 4


def element_offset(t: torch.Tensor, base: torch.Tensor) -> int:
    """Offset of t's first element from base's, in fp32 elements (both fp32, same device)."""
    if t.dtype != torch.float32 or base.dtype != torch.float32:
        raise ValueError(f"offsets are in fp32 elements: got {t.dtype} and {base.dtype}")
    if t.device != base.device:
        raise ValueError(f"tensor on {t.device}, base on {base.device}")
    diff = t.data_ptr() - base.data_ptr()
    if diff % 4:
        raise ValueError("tensor is not fp32-aligned relative to the base")
    return diff // 4
