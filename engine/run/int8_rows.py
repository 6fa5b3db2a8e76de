"""Row-local int8 building blocks shared by the graph-captured passes (`engine.run.body`, `.decoder`).

Each turns fp32 rows into int8 rows plus a per-row scale, or multiplies such rows by a
`QuantLinear` with the int8 path's own arithmetic (`engine.quant.linear`): exact int32 products and
the fixed fp32 epilogue. Every op is computed per row with a config fixed by the row length,
so a row's bits never depend on how many rows share the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kernels
from engine.kernels.decode_quant import gated_norm_quantize, swiglu_quantize
from engine.kernels.norm import norm_rows
from engine.quant.linear import QuantLinear, int8_matmul
from engine.run.tp import RowParallelLinear


def norm_quantize(
    x: torch.Tensor, norm: torch.Tensor, eps: float, linears: list[QuantLinear]
) -> list[tuple[QuantLinear, tuple[torch.Tensor, torch.Tensor]]]:
    """The int8 input of each linear fed by rms_norm(x) * norm; fused where s is folded (usual).

    Linears sharing a SmoothQuant divisor share one quantization of the row.
    """
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    normed: torch.Tensor | None = None
    out = []
    for lin in linears:
        key = id(lin.smooth)
        if key not in memo:
            if lin.smooth is None:
                memo[key] = kernels.rms_norm_quantize(x, norm, eps, backend="triton")
            else:
                if normed is None:
                    normed = norm_rows(x, norm, eps, mean=True, backend="triton")
                memo[key] = kernels.quantize_rows(normed, lin.smooth, backend="triton")
        out.append((lin, memo[key]))
    return out


def whole_rows(lin: object, *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under tensor parallelism, the whole rows of a row-parallel linear's per-head inputs.

    The fused quantizers then see exactly the rows one device sees (same kernel, same row,
    same bits) and each rank multiplies its own features (`RowParallelLinear.from_whole_rows`).
    """
    if isinstance(lin, RowParallelLinear):
        return tuple(lin.gather(p) for p in parts)
    return parts


def gemm(
    q: torch.Tensor,
    scale: torch.Tensor,
    lin: QuantLinear | RowParallelLinear,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`QuantLinear`'s arithmetic on an already quantized input (+ residual, added last in fp32).

    CUDA: the fused Triton GEMM. CPU: torch's exact integer product and the same epilogue
    (row scale, column scale, residual), each an exactly rounded elementwise op: row-local bits.
    """
    if isinstance(lin, RowParallelLinear):
        return lin.from_whole_rows(q, scale, residual)
    if q.is_cuda:
        return kernels.int8_gemm(q, lin.qweight, scale, lin.w_scale, residual)
    return kernels.scale_int32(int8_matmul(q, lin.qweight), scale, lin.w_scale, residual)


def projections(
    x: torch.Tensor, norm: torch.Tensor, eps: float, linears: list[QuantLinear]
) -> list[torch.Tensor]:
    """linear(rms_norm(x) * norm) for each of `linears` (sharing quantizations where they can)."""
    return [gemm(q, s, lin) for lin, (q, s) in norm_quantize(x, norm, eps, linears)]


# The linears of a layer that read one normed input: GDN in (qkv, output gate z, beta, alpha),
# attention in (q + gate, k, v), MLP in (gate, up).
MLP_INPUTS = ("ffn_gate", "ffn_up")
INPUT_GROUPS: tuple[tuple[str, ...], ...] = (
    ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
    ("attn_q", "attn_k", "attn_v"),
    MLP_INPUTS,
)


@dataclass(frozen=True)
class InputGroup:
    """Linears that read one quantized input, multiplied as one GEMM over their stacked rows.

    Why: at decode sizes a GEMM costs a ramp of a few microseconds however small its weight
    (beta and alpha are 48 rows), and a layer's 3-4 linears on one input were 3-4 launches; one
    launch over the stacked rows streams the same bytes. Each output column is the same exact
    int32 dot product and the same per-column epilogue whichever launch computes it, so the
    bits are those of the separate linears. `members` are the layer's linears after stacking:
    row views of `linear` (no second copy of the weights), kept to notice a replaced layer entry.

    `interleaved` (the MLP's gate and up): the members' rows alternate, row 2j gate j and row
    2j + 1 up j (`kernels.interleave_gate_up`), so gate and up are the output's even and odd
    columns. Why: a GEMM tile then holds both values of each SwiGLU output, and Hopper's one
    CUTLASS GEMM pairs them in its epilogue (`kernels.int8_gemm_swiglu`); the members' weights are
    then strided row views, their scale vectors (I floats) contiguous copies, as the kernels read
    scales: an edit in place of the stacked scales does not reach them.
    """

    linear: QuantLinear
    members: tuple[QuantLinear, ...]
    splits: tuple[int, ...]
    interleaved: bool = False

    def outputs(self, y: torch.Tensor) -> list[torch.Tensor]:
        """The members' outputs (column views of y, the stacked GEMM's [B, sum(splits)]), in order."""
        if self.interleaved:
            return list(kernels.split_gate_up(y))
        return list(y.split(self.splits, dim=1))

    def to(self, device: torch.device | str) -> InputGroup:
        """Unchanged: a layer moved elsewhere holds new linears, so `input_group` restacks them."""
        return self


def _same_smooth(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a is b or (a.shape == b.shape and a.device == b.device and torch.equal(a, b))


def stored_group(layer: dict, names: tuple[str, ...]) -> InputGroup | None:
    """The stacked form of `layer`'s linears `names` if `input_group` made it and its members are
    still the layer's entries; None otherwise (nothing is made here)."""
    group = layer.get("input_group:" + "+".join(names))
    if not isinstance(group, InputGroup):
        return None
    return group if all(a is layer.get(n) for a, n in zip(group.members, names, strict=True)) else None


def input_group(layer: dict, names: tuple[str, ...]) -> InputGroup | None:
    """The stacked form of `layer`'s linears `names`, made on first use (and again if one of
    them was replaced since); None where they cannot share one GEMM (not all plain
    `QuantLinear`s on one device with one SmoothQuant divisor; for the MLP, gate and up of one
    shape). Stacking replaces each entry of `layer` by a row view of the stacked weight, so
    memory does not grow; call it before a graph capture (`group_inputs`), not inside one. The
    MLP's gate and up are stacked interleaved (`InputGroup.interleaved`)."""
    lins = [layer.get(n) for n in names]
    if not all(type(lin) is QuantLinear for lin in lins):
        return None
    first: QuantLinear = lins[0]  # type: ignore[assignment]
    if (group := stored_group(layer, names)) is not None:
        return group
    if any(
        lin.qweight.device != first.qweight.device  # type: ignore[union-attr]
        or lin.qweight.shape[1] != first.qweight.shape[1]  # type: ignore[union-attr]
        or lin.w_scale.dtype != first.w_scale.dtype  # type: ignore[union-attr]
        or not _same_smooth(lin.smooth, first.smooth)  # type: ignore[union-attr]
        for lin in lins
    ):
        return None
    splits = tuple(lin.qweight.shape[0] for lin in lins)  # type: ignore[union-attr]
    interleaved = names == MLP_INPUTS
    if interleaved:
        if splits[0] != splits[1]:
            return None
        gate, up = lins
        stacked = QuantLinear(
            kernels.interleave_gate_up(gate.qweight, up.qweight),  # type: ignore[union-attr]
            kernels.interleave_gate_up(gate.w_scale, up.w_scale),  # type: ignore[union-attr]
            first.smooth,
        )
        # strided row views of the weight; the scales' tiny copies contiguous, as kernels read them
        weights, scales = kernels.split_gate_up(stacked.qweight, 0), kernels.split_gate_up(stacked.w_scale, 0)
        views = [(q, s.contiguous()) for q, s in zip(weights, scales, strict=True)]
    else:
        stacked = QuantLinear(
            torch.cat([lin.qweight for lin in lins]),  # type: ignore[union-attr]
            torch.cat([lin.w_scale for lin in lins]),  # type: ignore[union-attr]
            first.smooth,
        )
        ends = [sum(splits[: i + 1]) for i in range(len(splits))]
        starts = [end - rows for end, rows in zip(ends, splits, strict=True)]
        views = [(stacked.qweight[a:b], stacked.w_scale[a:b]) for a, b in zip(starts, ends, strict=True)]
    members = []
    for name, (qweight, w_scale) in zip(names, views, strict=True):
        view = QuantLinear(qweight, w_scale, first.smooth)
        layer[name] = view
        members.append(view)
    group = InputGroup(stacked, tuple(members), splits, interleaved)
    layer["input_group:" + "+".join(names)] = group
    return group


def group_inputs(layers: list[dict]) -> None:
    """Stack every layer's input groups now (at a pass's construction: before any capture)."""
    for layer in layers:
        for names in INPUT_GROUPS:
            input_group(layer, names)


def grouped_projections(
    x: torch.Tensor, norm: torch.Tensor, eps: float, layer: dict, names: tuple[str, ...]
) -> list[torch.Tensor]:
    """`projections` of `layer`'s linears `names` through one GEMM where they stack (column
    views of its output, in the order of `names`), else one GEMM each."""
    group = input_group(layer, names)
    if group is None:
        return projections(x, norm, eps, [layer[n] for n in names])
    (y,) = projections(x, norm, eps, [group.linear])
    return group.outputs(y)


def split_projections(
    x: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    layer: dict,
    names: tuple[str, ...],
    reads: torch.Tensor,
    at_reads: frozenset[str],
) -> list[torch.Tensor]:
    """`grouped_projections` where the linears in `at_reads` are wanted at the rows `reads`
    only (their outputs have reads.numel() rows) and the others at every row of x.

    Why: in the body's last layer only the read rows' query (or output gate) matters, while
    every row's keys and values (or DeltaNet inputs) are the segments' states. x is normed and
    quantized once for every row, as in `grouped_projections`; a read row's quantized input is
    then picked (row-local: its bits do not depend on the other rows) and multiplied by the
    read-only linears. A stacked group is multiplied in runs of consecutive members wanted at
    the same rows, each one GEMM over a row view of the stacked weight: each output column is
    the same exact int32 dot and the same epilogue whichever launch makes it, so every output
    has the bits `grouped_projections` gives that row. An interleaved group's members share
    every tile, so it is one GEMM at every row (at the read rows if all its members are wanted
    there) and the read-only members' outputs are picked at the read rows."""
    group = input_group(layer, names)
    lins = [group.linear] if group is not None else [layer[n] for n in names]
    quantized = norm_quantize(x, norm, eps, lins)
    picked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(q: torch.Tensor, s: torch.Tensor, lin: QuantLinear, rows: bool) -> torch.Tensor:
        if not rows:
            return gemm(q, s, lin)
        if id(q) not in picked:
            picked[id(q)] = (q.index_select(0, reads), s.index_select(0, reads))
        return gemm(*picked[id(q)], lin)

    if group is None:
        return [at(q, s, lin, n in at_reads) for n, (lin, (q, s)) in zip(names, quantized, strict=True)]
    ((stacked, (q, s)),) = quantized
    if group.interleaved:
        everywhere = [n not in at_reads for n in names]
        outs = group.outputs(at(q, s, stacked, not any(everywhere)))
        if all(everywhere) or not any(everywhere):
            return outs
        return [o if keep else o.index_select(0, reads) for o, keep in zip(outs, everywhere, strict=True)]
    out: list[torch.Tensor] = []
    j = 0
    while j < len(names):
        k = j
        while k + 1 < len(names) and (names[k + 1] in at_reads) == (names[j] in at_reads):
            k += 1
        lo, hi = sum(group.splits[:j]), sum(group.splits[: k + 1])
        run = QuantLinear(stacked.qweight[lo:hi], stacked.w_scale[lo:hi], stacked.smooth)
        y = at(q, s, run, names[j] in at_reads)
        out += list(y.split(group.splits[j : k + 1], dim=1))
        j = k + 1
    return out


def mlp_residual(h: torch.Tensor, layer: dict, eps: float) -> torch.Tensor:
    """h + ffn_down(silu(ffn_gate(x)) * ffn_up(x)), x = post-attention rms_norm(h): the layer's MLP.

    CUDA, gate and up stacked (interleaved: `input_group`), and the fused form faster at this M
    (`kernels.swiglu_fused`): the gate+up GEMM computes v = silu(gate) * up in its epilogue
    (`kernels.int8_gemm_swiglu`: on Hopper one CUTLASS GEMM pairing gate and up in registers; half
    the bytes out) and v is quantized for ffn_down (`kernels.int8_gemm_swiglu_quantize`): the same
    bits as the unfused path's stacked GEMM then `swiglu_quantize` on its even and odd columns.
    Under tensor parallelism each rank's v covers its own gate/up features; gathering v is
    gathering gate and up then the elementwise op, so the same bits (v is gathered, then
    `quantize_rows` finds the whole row's absmax); likewise the unfused path gathers the stacked
    output, whose ranks' interleaved blocks side by side are the whole interleaved row.
    """
    down = layer["ffn_down"]
    norm = layer["post_attention_norm"]
    group = input_group(layer, MLP_INPUTS)
    if group is None:  # not stackable: one GEMM each, then the pairs the quantizer reads
        gate, up = whole_rows(down, *projections(h, norm, eps, [layer[n] for n in MLP_INPUTS]))
        q, s = swiglu_quantize(kernels.interleave_gate_up(gate, up, dim=-1), down.smooth)
        return gemm(q, s, down, residual=h)
    if h.is_cuda and kernels.swiglu_fused(h.shape[0], group.linear.qweight):
        ((lin, (q, s)),) = norm_quantize(h, norm, eps, [group.linear])
        if isinstance(down, RowParallelLinear):  # v gathered whole first
            (v,) = whole_rows(down, kernels.int8_gemm_swiglu(q, lin.qweight, s, lin.w_scale))
            q, s = kernels.quantize_rows(v, down.smooth, backend="triton")
        else:  # v quantized where it is made
            q, s = kernels.int8_gemm_swiglu_quantize(q, lin.qweight, s, lin.w_scale, down.smooth)
        return gemm(q, s, down, residual=h)
    (gate_up,) = whole_rows(down, *projections(h, norm, eps, [group.linear]))
    q, s = swiglu_quantize(gate_up, down.smooth)
    return gemm(q, s, down, residual=h)


def gdn_output_residual(
    o: torch.Tensor, z: torch.Tensor, layer: dict, eps: float, h: torch.Tensor
) -> torch.Tensor:
    """h + ssm_out(rms_norm(o) * ssm_norm * silu(z)) per value head; o fp32 [B, HV, dv]."""
    dv = o.shape[-1]
    o, z = whole_rows(layer["ssm_out"], o.reshape(o.shape[0], -1), z)
    q, s = gated_norm_quantize(o.view(o.shape[0], -1, dv), z, layer["ssm_norm"], layer["ssm_out"].smooth, eps)
    return gemm(q, s, layer["ssm_out"], residual=h)


def attention_output_residual(out: torch.Tensor, layer: dict, h: torch.Tensor) -> torch.Tensor:
    """h + attn_output(out), out the gated attention rows fp32 [B, nh * hd]."""
    (out,) = whole_rows(layer["attn_output"], out)
    q, s = kernels.quantize_rows(out, layer["attn_output"].smooth, backend="triton")
    return gemm(q, s, layer["attn_output"], residual=h)


def lm_head(h: torch.Tensor, norm: torch.Tensor, output: QuantLinear, eps: float) -> torch.Tensor:
    """Logits fp32 [B, vocab] of the final rms_norm(h) * norm."""
    ((lin, (q, s)),) = norm_quantize(h, norm, eps, [output])
    return gemm(q, s, lin)
