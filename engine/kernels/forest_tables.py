"""The device tables a whole-forest pass reads (`engine.run.body` fills them, the forest kernels read them).

A pass runs every level of a packed forest in one sweep over the layers: the linears see all
T packed tokens at once (each weight is read once per pass, not once per level), and only the
work that carries state from a segment to its children is ordered by level. All tables are
contiguous int64 tensors on the device; a bucket (T rows, S segment slots, Q query blocks) has
fixed table shapes, so one captured CUDA graph replays any forest that fits it. Rows and slots
past the live ones are padding: they read nothing that matters and write nothing.

rows [T, ROW_FIELDS]: one record per packed token
    (segment slot, local index in the segment, live, token id)

segs [S, SEG_FIELDS]: one record per segment slot
    tok_lo          first packed row of the segment (its rows are tok_lo .. tok_lo + length - 1)
    length          tokens in the segment
    level           forest level (the recurrence runs level by level: a child starts from its
                    parent's final state, written by the previous level's launch)
    state_in        element offset (fp32, relative to `base`) of the initial Gated DeltaNet state
                    block [n_gdn, nv, dk, dv]; layer j's block is at + j * nv * dk * dv
    has_state_in    0: the segment starts from zeros (a root)
    state_out       offset of the segment's own final-state block [n_gdn, nv, dk, dv]
    conv_out        offset of the segment's own final conv-tail block [n_gdn, C, W - 1]
    live            0 for padding slots

conv_src [S, W - 1, 2]: where the W - 1 conv inputs before the segment's first token come from,
    oldest first, as (kind, value):
    CONV_ZERO       nothing before it (value unused): zeros
    CONV_ROW        packed row `value` of this pass (an ancestor computed in the same pass)
    CONV_TAIL       slot of a stored tail: element offset `value` = block offset + slot; channel c
                    of layer j is at base + value + j * C * (W - 1) + c * (W - 1)
    A segment's final tail (its last W - 1 inputs) follows from its own rows and, when it is
    shorter than W - 1, from these sources.

pieces [n_attn, S, P, PIECE_FIELDS]: per attention layer and segment slot, the K/V pieces its
    queries read (the format of `engine.kernels.decode_rows`: k_off, v_off, length,
    rows_per_head; blocks [nkv, rows_per_head, hd] fp32 at base + off): ancestors oldest first,
    unused slots with length 0, and the segment's own K/V block last (length = the segment's
    length, read causally: a query at local index l sees own keys 0 .. l). The own block is
    where the pass writes the segment's keys and values.

qblocks [Q, QBLOCK_FIELDS]: one record per attention query block of BLOCK_M consecutive
    tokens of one segment, aligned to the segment start: (segment slot, first local index, live).

reads [R] int64: packed rows whose logits the pass returns (padding entries point at row 0 and
    their logits are ignored).
"""

from __future__ import annotations

ROW_SEG, ROW_LOCAL, ROW_LIVE, ROW_TOKEN = range(4)
ROW_FIELDS = 4

(
    SEG_TOK_LO,
    SEG_LENGTH,
    SEG_LEVEL,
    SEG_STATE_IN,
    SEG_HAS_STATE_IN,
    SEG_STATE_OUT,
    SEG_CONV_OUT,
    SEG_LIVE,
) = range(8)
SEG_FIELDS = 8

CONV_ZERO, CONV_ROW, CONV_TAIL = range(3)

QB_SEG, QB_LOCAL, QB_LIVE = range(3)
QBLOCK_FIELDS = 3

BLOCK_M = 16  # query rows per attention program (tl.dot needs >= 16)
