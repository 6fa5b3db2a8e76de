"""Time the decode step's attention kernel at the 27B / 4B head shapes over launch variants (CUDA).

    PYTHONPATH=. python3 ops/bench/bench_decode_attention.py [--shape 27B] [--out attn.json]

`engine.kernels.decode_attention.decode_attention` reads every row's K/V pieces where they lie
(fp32, [kv_heads, rows, head_dim] blocks). The shape is `bench_engine.py --decode-only`'s: each
row its own ~27-token system piece, a 256-token prompt piece and a thought of 24 tokens so far;
plus one row over a 8,192-token evidence piece (a thought after workload (c)). Each variant -
the prefix split S, keys per block, warps and stages of the split kernel, the least chunks per
used split program, the dot precision -
is timed inside a CUDA graph (`triton.testing.do_bench_cudagraph`) at 1, 16 and 64 rows, and
checked the way the decoder needs it: row 0's output bit for bit the same alone and inside the
64-row batch (a variant whose row bits move with the batch is reported, never chosen). GB/s
counts the K/V bytes every row must read once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import shape_config  # noqa: E402

import engine.kernels.decode_attention as da  # noqa: E402

ROWS = (1, 16, 64)
SYSTEM, PROMPT, THOUGHT, LONG = 27, 256, 24, 8192


def timed(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=50))


def case(shape: str, rows: int, evidence: int, gen: torch.Generator) -> dict:
    """`rows` rows, each with its own system, evidence and thought pieces, fp32 K/V in one pool."""
    cfg = shape_config(shape)
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    per_row = 2 * nkv * hd * (SYSTEM + evidence + 64)
    base = torch.randn(rows * per_row + 64, generator=gen).cuda()
    pieces = torch.zeros(rows, 4, 4, dtype=torch.int64)
    used = 0
    for r in range(rows):
        for p, n in enumerate((SYSTEM, evidence, 0, 64)):
            k_off, v_off = used, used + nkv * n * hd
            used += 2 * nkv * n * hd
            pieces[r, p] = torch.tensor([k_off, v_off, n if p < 3 else 0, n])
    table = torch.zeros(rows, 5, dtype=torch.int64)
    table[:, 1] = THOUGHT  # thought_len
    table[:, 4] = 1  # live
    return dict(
        q=torch.randn(rows, nh, hd, generator=gen).cuda(),
        qg=torch.randn(rows, nh * 2 * hd, generator=gen).cuda(),
        base=base,
        rows=table.cuda(),
        pieces=pieces.cuda(),
        nkv=nkv,
        kv_bytes=rows * 2 * nkv * hd * 4 * (SYSTEM + evidence + THOUGHT + 1),
    )


def run(c: dict, splits: int, dots: str) -> torch.Tensor:
    return da.decode_attention(c["q"], c["qg"], c["base"], c["rows"], c["pieces"], num_kv_heads=c["nkv"],
                               splits=splits, dots=dots)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="27B")
    ap.add_argument("--splits", default="4,8,16,32")
    ap.add_argument("--blocks", default="16,32,64")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--dots", default="ieee,bf16")
    ap.add_argument("--min-chunks", default="1,2,3", help="SPLIT_MIN_CHUNKS values")
    ap.add_argument("--align", default=str(da.PIECE_ALIGN), help="PIECE_ALIGN values (1: no alignment hint)")
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    cases = {f"{r}x{PROMPT}": case(args.shape, r, PROMPT, gen) for r in ROWS}
    cases[f"1x{LONG}"] = case(args.shape, 1, LONG, gen)
    shipped = (
        da.SPLITS, da.BLOCK_L_WIDE, dict(da.SPLIT_WARPS), da.SPLIT_STAGES, da.SPLIT_MIN_CHUNKS, da.PIECE_ALIGN
    )  # fmt: skip
    results = []
    grid = itertools.product(
        args.dots.split(","),
        *(
            map(int, a.split(","))
            for a in (args.splits, args.blocks, args.warps, args.stages, args.min_chunks, args.align)
        ),
    )
    for dots, splits, block, warps, stages, min_chunks, align in grid:
        da.BLOCK_L_WIDE, da.SPLIT_STAGES, da.SPLIT_MIN_CHUNKS = block, stages, min_chunks
        da.SPLIT_WARPS[dots], da.PIECE_ALIGN = warps, align
        name = f"{dots}/S{splits}/BL{block}/w{warps}/s{stages}/mc{min_chunks}/a{align}"
        try:
            big = cases[f"{ROWS[-1]}x{PROMPT}"]
            together = run(big, splits, dots)[0]
            alone_case = {**big, **{k: big[k][:1].contiguous() for k in ("q", "qg", "rows", "pieces")}}
            alone = run(alone_case, splits, dots)[0]
            same = bool(torch.equal(together, alone))
            line = {"variant": name, "row_bits_batch_independent": same}
            for label, c in cases.items():
                ms = timed(lambda c=c, s=splits, d=dots: run(c, s, d))
                line[f"{label}_us"] = round(1e3 * ms, 2)
                line[f"{label}_gbs"] = round(c["kv_bytes"] / (ms * 1e-3) / 1e9, 1)
        except Exception as exc:  # a variant Triton cannot build (shared memory): reported, skipped
            line = {"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        results.append(line)
        print(json.dumps(line), flush=True)
    da.SPLITS, da.BLOCK_L_WIDE, da.SPLIT_WARPS, da.SPLIT_STAGES, da.SPLIT_MIN_CHUNKS, da.PIECE_ALIGN = shipped
    ok = [r for r in results if r.get("row_bits_batch_independent")]
    for label in cases:
        best = min(ok, key=lambda r: r[f"{label}_us"], default=None)
        if best:
            print(f"best {label}: {best['variant']} {best[f'{label}_us']} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
